"""Checks 4a and 4b: CUDA libraries -- several cuDNN / cuBLAS wheels of one family, pins that
disagree, and ``LD_LIBRARY_PATH`` shadowing the wheels' libraries."""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from preheat.doctor.context import Context, _FactError, _pip_jax, torch_index
from preheat.doctor.dists import _distributions, _norm
from preheat.doctor.results import OK, WARN, Check, CheckResult

_NVIDIA_FAMILY_RE = re.compile(r"^nvidia-(cudnn|cublas)(?:-cu(\d+))?$")
_CUDA_LIB_FILE_RE = re.compile(r"^lib(cudnn|cublas|cublasLt|cudart|cufft|cusparse|cusolver|nccl|nvrtc|nvJitLink)\b.*\.so")


def _family(name: str, version: str) -> tuple[str, str] | None:
    m = _NVIDIA_FAMILY_RE.match(name)
    if not m:
        return None
    major = m.group(2) or (version.split(".")[0] if version else "?")
    return m.group(1), major


def _lib_files(dist: metadata.Distribution) -> set[str]:
    try:
        files = dist.files or []
    except Exception:
        return set()
    return {str(f).replace("\\", "/") for f in files if ".so" in str(f)}


def _check_cuda_libs(ctx: Context) -> CheckResult:
    title = "CUDA libraries"
    dists = _distributions()
    families: dict[str, list[tuple[str, str, str]]] = {}
    for name, dist in dists.items():
        fam = _family(name, dist.version)
        if fam:
            families.setdefault(fam[0], []).append((name, dist.version, fam[1]))
    details: dict[str, Any] = {fam: [f"{n} {v}" for n, v, _ in sorted(items)] for fam, items in families.items()}

    # who requires which nvidia distribution, and with which specifier
    requirers: dict[str, list[tuple[str, str]]] = {}
    try:
        from packaging.requirements import Requirement

        for name, dist in dists.items():
            for req_s in dist.requires or []:
                try:
                    req = Requirement(req_s)
                except Exception:
                    continue
                target = _norm(req.name)
                if not _NVIDIA_FAMILY_RE.match(target):
                    continue
                if req.marker is not None and not any(
                    _marker_true(req.marker, extra) for extra in ("", "with-cuda", "with_cuda")
                ):
                    continue
                requirers.setdefault(target, []).append((name, str(req.specifier)))
    except ImportError:  # packaging is missing: only the side-by-side test below runs
        pass

    problems: list[str] = []
    fixes: list[str] = []
    for fam, items in sorted(families.items()):
        majors = sorted({m for _, _, m in items})
        if len(items) < 2:
            continue
        desc = []
        for n, v, _ in sorted(items):
            by = sorted({r for r, _ in requirers.get(n, [])})
            desc.append(f"{n} {v}" + (f" (needed by {', '.join(by)})" if by else ""))
        overlap = _shared_files([dists[n] for n, _, _ in items])
        text = f"{len(items)} {fam} wheels installed side by side: {'; '.join(desc)}"
        if overlap:
            text += f"; they write the same file {overlap}, so the one installed last overwrote the other"
        else:
            text += "; torch and JAX may load a different one than they were built for"
        problems.append(text)
        fixes.append(_family_fix(ctx, fam, items, majors, requirers, dists))

    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        for target, reqs in sorted(requirers.items()):
            if target not in dists:
                continue
            installed = dists[target].version
            bad = sorted((r, s) for r, s in reqs if s and not SpecifierSet(s).contains(Version(installed), prereleases=True))
            if not bad:
                continue
            problems.append(
                f"{target} {installed} is installed but "
                + ", ".join(f"{r} requires {target}{s}" for r, s in bad)
            )
            specs = [(r, SpecifierSet(s)) for r, s in reqs if s]
            # A "==" pin that the other requirers reject cannot be met by reinstalling the library:
            # the pinning package has to move (its newer releases pin newer CUDA libraries).
            stuck = sorted(
                {
                    r
                    for r, spec in specs
                    for pin in spec
                    if pin.operator in ("==", "===")
                    and not all(other.contains(pin.version, prereleases=True) for _, other in specs)
                }
            )
            if stuck:
                fixes.append(
                    f"pip install -U {' '.join(stuck)} (its pin on {target} is older than the others accept); "
                    "if no release fits, give torch and JAX separate virtualenvs"
                )
            else:
                combined = ",".join(sorted({s for _, s in reqs if s}))
                fixes.append(f'pip install "{target}{combined}"')
    except ImportError:
        pass

    if not problems:
        found = ", ".join(f"{n} {v}" for items in families.values() for n, v, _ in sorted(items)) or "none installed"
        return CheckResult("cuda_libs", title, OK, f"one cuDNN / cuBLAS wheel per family ({found})", None, details)
    return CheckResult("cuda_libs", title, WARN, " | ".join(problems), " ; ".join(fixes), details)


def _marker_true(marker: Any, extra: str) -> bool:
    try:
        return bool(marker.evaluate({"extra": extra}))
    except Exception:
        return False


def _shared_files(dists: list[metadata.Distribution]) -> str | None:
    seen: dict[str, int] = {}
    for i, d in enumerate(dists):
        for f in _lib_files(d):
            if f in seen and seen[f] != i:
                return f
            seen[f] = i
    return None


def _family_fix(
    ctx: Context,
    fam: str,
    items: list[tuple[str, str, str]],
    majors: list[str],
    requirers: dict[str, list[tuple[str, str]]],
    dists: dict[str, Any],
) -> str:
    """Keep one CUDA major: move the packages that need the other major, drop its wheels."""
    keep = None
    try:
        build = ctx.plan()["build"]
        if build:
            keep = build.removeprefix("cuda")
    except _FactError:
        pass
    if keep not in majors:
        plugin_majors = [m.group(1) for p in dists if (m := re.match(r"jax-cuda(\d+)-plugin$", p))]
        keep = next((m for m in plugin_majors if m in majors), None) or max(majors, key=lambda m: int(m) if m.isdigit() else -1)
    remove = sorted(n for n, _, m in items if m != keep)
    kept = sorted(n for n, _, m in items if m == keep)
    steps: list[str] = []
    users = sorted({r for n in remove for r, _ in requirers.get(n, [])})
    wrong_plugins = sorted(p for p in dists if re.match(rf"jax-cuda(?!{keep}-)\d+-(plugin|pjrt)$", p))
    if wrong_plugins:
        steps.append(f"pip uninstall -y {' '.join(wrong_plugins)}")
    steps.append(f"pip uninstall -y {' '.join(remove)}")
    if any(u.startswith("jax") for u in users) or wrong_plugins:
        steps.append(_pip_jax(f"cuda{keep}"))
    if "torch" in users:
        index = "cu130" if keep == "13" else "cu128"
        steps.append(f"pip install -U --force-reinstall torch --index-url {torch_index()}/{index}")
    steps.append(f"pip install --force-reinstall --no-deps {' '.join(kept)}")
    return f"keep CUDA {keep} only: " + " && ".join(steps)


# ----------------------------------------------------------------------------------------------
# Check 4b: LD_LIBRARY_PATH


def _check_ld_library_path(ctx: Context) -> CheckResult:
    title = "LD_LIBRARY_PATH"
    value = os.environ.get("LD_LIBRARY_PATH", "")
    if not value.strip():
        return CheckResult("ld_library_path", title, OK, "LD_LIBRARY_PATH is not set: JAX and torch load the CUDA libraries of their pip wheels")
    entries = [e for e in value.split(":") if e]
    shadowing: list[str] = []
    listed: list[str] = []  # folders read, with no CUDA toolkit library in them
    for e in entries:
        try:
            libs = sorted({m.group(1) for p in Path(e).iterdir() if (m := _CUDA_LIB_FILE_RE.match(p.name))})
        except OSError:  # not there (yet) or unreadable: judged by its name
            if re.search(r"cuda|nvidia|cudnn", e, re.IGNORECASE):
                shadowing.append(e)
            continue
        if libs:
            shadowing.append(f"{e} (lib{', lib'.join(libs)})")
        else:
            listed.append(e)
    if not shadowing and len(listed) == len(entries):
        # e.g. /usr/local/nvidia/lib64 on GPU pods: the driver's libraries only (libcuda, libnvidia-*)
        return CheckResult("ld_library_path", title, OK,
                           f"LD_LIBRARY_PATH={value} holds no CUDA toolkit library (cuDNN, cuBLAS, CUDA runtime, ...): "
                           "JAX and torch load those of their pip wheels", None, {"LD_LIBRARY_PATH": entries})
    if shadowing:
        finding = (
            f"LD_LIBRARY_PATH={value} puts CUDA libraries ahead of the pip wheels' CUDA: {'; '.join(shadowing)}; "
            "JAX then loads mismatched cuDNN/cuBLAS (JAX recommends leaving it unset)"
        )
    else:
        finding = f"LD_LIBRARY_PATH={value} is set; it can shadow the pip wheels' CUDA libraries (JAX recommends leaving it unset)"
    return CheckResult(
        "ld_library_path",
        title,
        WARN,
        finding,
        "unset LD_LIBRARY_PATH (and remove it from ~/.bashrc / the image's ENV)",
        {"LD_LIBRARY_PATH": entries, "cuda_entries": shadowing},
    )


CUDA_LIBS = Check("cuda_libs", "CUDA libraries", _check_cuda_libs)
LD_LIBRARY_PATH = Check("ld_library_path", "LD_LIBRARY_PATH", _check_ld_library_path)
