"""A fake site-packages holding only *.dist-info folders (what importlib.metadata reads)."""

from __future__ import annotations

from pathlib import Path


def fake_site(root: Path, dists: dict[str, tuple[str, list[str], list[str]]]) -> Path:
    """``dists``: name -> (version, Requires-Dist lines, RECORD file paths)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, (version, requires, files) in dists.items():
        info = root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        meta += [f"Requires-Dist: {r}" for r in requires]
        (info / "METADATA").write_text("\n".join(meta) + "\n")
        for f in files:  # the files exist: Python 3.12's importlib.metadata lists only files that do
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            (root / f).touch()
        record = [f"{f},," for f in files] + [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
        (info / "RECORD").write_text("\n".join(record) + "\n")
    return root
