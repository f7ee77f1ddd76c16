"""Pack a pure-Python distribution installed in this interpreter's environment back into a wheel.

Used by ``GPU_WHEELS_FROM_ENV=1 scripts/gpu_wheels.sh`` to fill the GPU wheel folder without a
package registry (the CPU dry run of scripts/gpu_check.sh in CI): the files come from the
installed distribution's RECORD, the RECORD is written anew with sha256 hashes, and anything that
is not a pure-Python wheel (``Root-Is-Purelib: true``, tag ``py3-none-any``) is refused.

    python scripts/gpu_repack.py DEST_DIR NAME [NAME ...]
"""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from importlib import metadata
from pathlib import Path, PurePosixPath

# Installer bookkeeping that a wheel does not carry (RECORD is regenerated).
_SKIP_META = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def repack(name: str, dest: Path) -> Path:
    """Write ``<name>-<version>-py3-none-any.whl`` into ``dest`` from the installed files."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise SystemExit(f"gpu_repack: {name} is not installed in {sys.prefix}") from None
    files = dist.files or []
    info = next((f for f in files if f.parts[0].endswith(".dist-info") and f.name == "WHEEL"), None)
    if info is None:
        raise SystemExit(f"gpu_repack: {name} has no .dist-info/WHEEL (not installed from a wheel)")
    wheel_meta = Path(dist.locate_file(info)).read_text()
    if "Root-Is-Purelib: true" not in wheel_meta or "Tag: py3-none-any" not in wheel_meta:
        raise SystemExit(f"gpu_repack: {name} is not a pure-Python (py3-none-any) wheel; download it instead")
    dist_info = info.parts[0]
    stem = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}"
    out = dest / f"{stem}-py3-none-any.whl"
    record: list[str] = []
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(files, key=str):
            rel = PurePosixPath(*f.parts)
            if rel.parts[0] == ".." or "__pycache__" in rel.parts or rel.suffix == ".pyc":
                continue  # console scripts (pip writes them anew) and byte code
            if rel.parts[0] == dist_info and rel.name in _SKIP_META and len(rel.parts) == 2:
                continue
            data = Path(dist.locate_file(f)).read_bytes()
            zf.writestr(str(rel), data)
            record.append(f"{rel},{_digest(data)},{len(data)}")
        record.append(f"{dist_info}/RECORD,,")
        zf.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    dest = Path(argv[0])
    dest.mkdir(parents=True, exist_ok=True)
    for name in argv[1:]:
        print(repack(name, dest).name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
