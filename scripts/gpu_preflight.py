"""The seconds-long checks that scripts/gpu_check.sh runs before it installs or measures anything.

The GPU machine has no network and its own Python with its own packages, so nothing can be fixed
there: this says, before any device time is spent on measuring, what is missing or too old.

1. The wheel folder (filled by scripts/gpu_wheels.sh): one wheel per name, preheat's own and
   each of ``CARRIED``; preheat's wheel is compared file by file with ``src/preheat`` (exit 3 when
   it is stale, so that the caller can rebuild it from the tree).
2. Every requirement of preheat (with ``EXTRAS``) and of the carried wheels, read from the
   wheels' own METADATA, against what is installed (or carried): what pip would check, offline.
3. preheat's own tested range (``TESTED``): below the minimum stops; newer than the newest
   tested is a warning (the run itself will tell). jaxlib must equal jax; on a GPU a CUDA plugin
   of jaxlib's version must be installed, and ``nvidia-smi`` must answer.

    python scripts/gpu_preflight.py --wheels DIR --mode gpu|dry [--src src/preheat]
        [--json OUT.json] [--install-list FILE] [--preheat-wheel PATH]

Exit status: 0 ready (``--install-list`` holds the wheels to install, one per line); 2 something
is missing or unsupported (each problem on one line, starting ``MISSING``/``UNSUPPORTED``/...);
3 only preheat's wheel is stale.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

# The extras of preheat that the GPU run uses: torch (the comparison backend: torch + diffusers)
# and bench (matplotlib, psutil).
EXTRAS = ("torch", "bench")
# Pure-Python distributions the GPU image lacks, carried as wheels (scripts/gpu_wheels.sh).
CARRIED = ("diffusers",)
# Declared requirements of a carried wheel that are never imported on this Python, so they are
# neither carried nor required. Each with the reason.
NOT_IMPORTED = {
    "importlib-metadata": (3, 8),  # diffusers/utils/import_utils.py imports the backport only on Python < 3.8
}
# (minimum, newest tested) major.minor per distribution. Minimums at or above the declared ones;
# "newest tested": jax 0.10 / torch 2.13 in CI (CPU), jax 0.11 / torch 2.11 on the GPU image.
TESTED = {
    "jax": ("0.6", "0.11"),
    "jaxlib": ("0.6", "0.11"),
    "flax": ("0.11", "0.12"),
    "torch": ("2.7", "2.13"),
    "diffusers": ("0.30", "0.42"),
}
# Versions recorded in the report (besides every requirement checked).
REPORTED = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt",
            "flax", "optax", "torch", "triton", "transformers", "tokenizers", "safetensors", "numpy",
            "huggingface-hub", "pip", "setuptools")


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _wheel_name(path: Path) -> tuple[str, str]:
    parts = path.name[: -len(".whl")].split("-")
    return _canon(parts[0]), parts[1]


def _wheel_metadata(path: Path) -> Any:
    from email.parser import Parser

    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(zf.read(name).decode())


def stale_files(wheel: Path, src: Path) -> list[str]:
    """Files of ``src`` (the package folder) that the wheel lacks, or holds with other bytes, or
    holds but the tree does not: empty when the wheel was built from this tree."""
    pkg = src.name
    with zipfile.ZipFile(wheel) as zf:
        packed = {n[len(pkg) + 1:]: hashlib.sha256(zf.read(n)).hexdigest()
                  for n in zf.namelist() if n.startswith(pkg + "/") and not n.endswith("/")}
    tree = {str(p.relative_to(src)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    return sorted(n for n in set(packed) | set(tree) if packed.get(n) != tree.get(n))


def _major_minor(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release[:2]


def check(wheels: Path, mode: str, src: Path | None, preheat_wheel: Path | None) -> dict[str, Any]:
    from packaging.requirements import Requirement
    from packaging.version import Version

    problems: list[str] = []
    warnings: list[str] = []
    checked: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {"mode": mode, "python": platform.python_version(), "executable": sys.executable,
                              "problems": problems, "warnings": warnings, "requirements": checked}

    # 1. the wheel folder
    if not wheels.is_dir():
        problems.append(f"MISSING wheel folder {wheels}: run `bash scripts/gpu_wheels.sh` on a machine with "
                        "registry access and carry the folder (docs/gpu.md)")
        return report
    found: dict[str, list[Path]] = {}
    for w in sorted(wheels.glob("*.whl")):
        found.setdefault(_wheel_name(w)[0], []).append(w)
    if preheat_wheel is not None:
        found["preheat"] = [preheat_wheel]
    for name, paths in found.items():
        if len(paths) > 1:
            problems.append(f"DUPLICATE wheels for {name} in {wheels}: {', '.join(p.name for p in paths)} "
                            "(keep one version: rerun scripts/gpu_wheels.sh)")
    for name in ("preheat", *CARRIED):
        if name not in found:
            problems.append(f"MISSING wheel {name} in {wheels}: rerun `bash scripts/gpu_wheels.sh`")
    extra = sorted(set(found) - {"preheat", *map(_canon, CARRIED)})
    if extra:
        warnings.append(f"wheels not asked for in {wheels}, installed too: {', '.join(extra)}")
    install = [paths[0] for paths in found.values()]
    report["wheels"] = {name: paths[0].name for name, paths in found.items()}
    report["preheat_wheel_rebuilt_from_tree"] = preheat_wheel is not None
    report["install"] = [str(p) for p in install]
    if problems:
        return report
    carried = {name: _wheel_name(paths[0])[1] for name, paths in found.items()}

    # 2. requirements from the wheels' own metadata
    env_py = Version(platform.python_version())
    needs: list[tuple[str, Requirement]] = []
    for name, paths in found.items():
        meta = _wheel_metadata(paths[0])
        requires_python = meta.get("Requires-Python")
        if requires_python:
            from packaging.specifiers import SpecifierSet

            if env_py not in SpecifierSet(requires_python):
                problems.append(f"UNSUPPORTED python {env_py}: {name} requires {requires_python}")
        extras = ("",) + (EXTRAS if name == "preheat" else ())
        for line in meta.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if _canon(req.name) == "preheat":
                continue  # preheat[...] self-references of other extras
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
                continue
            needs.append((name, req))
    for who, req in needs:
        name = _canon(req.name)
        skip = NOT_IMPORTED.get(name)
        if skip is not None and sys.version_info >= skip:
            checked.setdefault(name, {"required_by": [], "status": "not imported on this Python, not needed"})
            checked[name]["required_by"].append(f"{who}: {req}")
            continue
        have = carried.get(name)
        source = "carried" if have else "installed"
        have = have or _installed(req.name)
        entry = checked.setdefault(name, {"version": have, "source": source, "required_by": []})
        entry["required_by"].append(f"{who}: {req}")
        if have is None:
            problems.append(f"MISSING {req.name} (required by {who}: {req}); add it to CARRIED in "
                            "scripts/gpu_wheels.sh and scripts/gpu_preflight.py")
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"UNSUPPORTED {req.name} {have} (required by {who}: {req})")

    # 3. preheat's tested ranges, jax consistency, the GPU
    for name, (low, high) in TESTED.items():
        have = carried.get(name) or _installed(name)
        if have is None:
            continue  # a requirement above already says so if it is needed
        if _major_minor(have) < _major_minor(low + ".0"):
            problems.append(f"UNSUPPORTED {name} {have}: preheat needs >= {low}")
        elif _major_minor(have) > _major_minor(high + ".0"):
            warnings.append(f"{name} {have} is newer than the newest tested ({high}.x); continuing")
    jax_v, jaxlib_v = _installed("jax"), _installed("jaxlib")
    if jax_v and jaxlib_v and jax_v != jaxlib_v:
        problems.append(f"UNSUPPORTED jax {jax_v} with jaxlib {jaxlib_v}: they must be the same version")
    versions = {name: _installed(name) for name in REPORTED}
    report["versions"] = {**{k: v for k, v in versions.items() if v},
                          **{f"{k} (carried)": v for k, v in carried.items()}}
    if mode == "gpu":
        plugins = {n: v for n, v in versions.items() if n.startswith("jax-cuda") and v}
        if not any(n.endswith("-plugin") for n in plugins):
            problems.append("MISSING jax CUDA plugin (jax-cuda13-plugin or jax-cuda12-plugin): "
                            "JAX would run on the CPU")
        for n, v in plugins.items():
            if jaxlib_v and v != jaxlib_v:
                problems.append(f"UNSUPPORTED {n} {v} with jaxlib {jaxlib_v}: they must be the same version")
        smi = shutil.which("nvidia-smi")
        if smi is None:
            problems.append("MISSING nvidia-smi: this is not a GPU machine (GPU_CHECK_DRY=1 runs the CPU dry run)")
        else:
            try:
                proc = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,compute_cap",
                                       "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
                report["gpus"] = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
                if proc.returncode != 0 or not report["gpus"]:
                    problems.append(f"UNSUPPORTED nvidia-smi exit {proc.returncode}: {proc.stderr.strip()[:200]}")
            except subprocess.TimeoutExpired:
                problems.append("UNSUPPORTED nvidia-smi did not answer within 30 s")

    # 1b. a stale preheat wheel (last, so that exit 3 means: nothing else is wrong)
    if src is not None and preheat_wheel is None:
        stale = stale_files(found["preheat"][0], src)
        report["stale_preheat_files"] = stale
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, required=True)
    ap.add_argument("--mode", choices=("gpu", "dry"), required=True)
    ap.add_argument("--src", type=Path, help="the package folder preheat's wheel must match (src/preheat)")
    ap.add_argument("--preheat-wheel", type=Path, help="use this preheat wheel instead of the folder's")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--install-list", type=Path)
    args = ap.parse_args()
    try:
        import packaging  # noqa: F401
    except ImportError:
        print(f"preflight: MISSING packaging in {sys.executable} (pip's dependency; needed to read requirements)")
        return 2
    report = check(args.wheels, args.mode, args.src, args.preheat_wheel)
    stale = report.get("stale_preheat_files") or []
    for w in report["warnings"]:
        print(f"preflight: warning: {w}")
    for p in report["problems"]:
        print(f"preflight: {p}")
    if stale and not report["problems"]:
        print(f"preflight: STALE preheat wheel: {len(stale)} file(s) differ from {args.src} "
              f"(first: {stale[0]}); rebuilding it from the tree")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if report["problems"]:
        return 2
    if args.install_list:
        args.install_list.write_text("".join(f"{p}\n" for p in report["install"]))
    if stale:
        return 3
    v = report["versions"]
    print("preflight: ok: python {}; {}".format(report["python"], ", ".join(f"{k} {x}" for k, x in v.items()
                                                                            if k in ("jax", "jaxlib", "torch", "flax")
                                                                            or "carried" in k or "plugin" in k)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
