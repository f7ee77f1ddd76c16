"""Check 2: the JAX backend -- does JAX start, compute right, and on the GPU when there is one."""

from __future__ import annotations

import os
import re
from typing import Any

from preheat.doctor import dists
from preheat.doctor.context import (
    _DRIVER_FIX,
    DRIVER_MIN_CUDA12,
    DRIVER_MIN_CUDA13,
    Context,
    _count,
    _FactError,
    _pip_jax,
)
from preheat.doctor.dists import _jax_gpu_plugins
from preheat.doctor.probe import ProbeResult, _first_relevant_line, _signal_name
from preheat.doctor.results import FAIL, OK, Check, CheckResult
from preheat.doctor.runner import _fmt_s

_GPU_BACKENDS = ("gpu", "cuda", "rocm")


def _jax_fix(ctx: Context, plugins: dict[str, str]) -> str:
    """The exact command that gets JAX onto this GPU."""
    jp = os.environ.get("JAX_PLATFORMS", "").strip()
    if jp and not any(p.strip() in ("cuda", "gpu") for p in jp.split(",")):
        return f"unset JAX_PLATFORMS (it is {jp!r}, which keeps JAX off the GPU)"
    try:
        plan = ctx.plan()
    except _FactError:
        plan = {"build": None, "why": "driver unknown"}
    build = plan["build"]
    if build is None:
        if plan["why"] == "driver too old":
            return _DRIVER_FIX
        if plan["why"] == "gpu too old":
            return "use a newer GPU (SM >= 5.2 for jax[cuda12], SM >= 7.5 for jax[cuda13])"
        return f'{_pip_jax("cuda12")} (driver >= {DRIVER_MIN_CUDA12}) or {_pip_jax("cuda13")} (driver >= {DRIVER_MIN_CUDA13})'
    wrong = sorted(p for p in plugins if re.match(r"jax-(cuda\d+|rocm\d+)-", p) and not p.startswith(f"jax-{build}-"))
    cmd = _pip_jax(build)
    if wrong:
        cmd = f"pip uninstall -y {' '.join(wrong)} && {cmd}"
    return cmd


def _check_jax(ctx: Context) -> CheckResult:
    title = "JAX backend"
    jax_v, jaxlib_v = dists._dist_version("jax"), dists._dist_version("jaxlib")
    plugins = _jax_gpu_plugins()
    details: dict[str, Any] = {"jax": jax_v, "jaxlib": jaxlib_v, "plugins": plugins, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS")}
    gpu = ctx.gpu_present()
    probe: ProbeResult = ctx.fact("jax_probe")
    details["probe"] = {"status": probe.status, "elapsed_s": round(probe.elapsed_s, 2), **probe.data}

    def res(status: str, finding: str, fix: str | None = None) -> CheckResult:
        return CheckResult("jax", title, status, finding, fix, details)

    plugin_text = ", ".join(f"{k} {v}" for k, v in plugins.items()) or "no GPU plugin"
    versions = f"jax {jax_v or '?'} / jaxlib {jaxlib_v or '?'} + {plugin_text}"
    mismatched = [k for k, v in plugins.items() if k.startswith("jax-cuda") and jaxlib_v and v != jaxlib_v]

    if probe.status == "skipped":
        ctx.gpu_backend = False
        return res(FAIL, "jax is not installed", _jax_fix(ctx, plugins) if gpu else 'pip install -U "jax"')
    if probe.status == "timeout":
        return res(
            FAIL,
            f"{versions}: `import jax` + a tiny computation did not finish within {_fmt_s(probe.timeout_s)} "
            "(a CUDA plugin hanging at initialisation?)",
            'run `python -c "import jax; print(jax.devices())"` to see it hang; if it does: '
            + (_jax_fix(ctx, plugins) if gpu else 'pip install -U --force-reinstall "jax"')
            + "; if JAX is just slow here rerun with PREHEAT_DOCTOR_TIMEOUT=60",
        )
    if probe.status == "crashed":
        line = _first_relevant_line(probe.stderr)
        return res(
            FAIL,
            f"{versions}: the JAX probe process died ({_signal_name(probe.rc)}): {line or 'no output'}",
            _jax_fix(ctx, plugins) if gpu else 'pip install -U --force-reinstall "jax" "jaxlib"',
        )
    data = probe.data
    if not data.get("ok"):
        err = data.get("error") or "unknown error"
        line = _first_relevant_line(err)
        extra = f" (plugin versions {', '.join(mismatched)} differ from jaxlib {jaxlib_v})" if mismatched else ""
        ctx.gpu_backend = False
        return res(FAIL, f"{versions}: JAX fails to start: {line}{extra}", _jax_fix(ctx, plugins))

    backend = str(data.get("backend") or "unknown")
    devices = data.get("devices") or []
    dev_text = ", ".join(f"{n}x {k}" for k, n in _count(devices).items()) or "no devices"
    details["backend"] = backend
    on_gpu = backend in _GPU_BACKENDS
    ctx.gpu_backend = on_gpu
    if data.get("result_ok") is False:
        return res(
            FAIL,
            f"{versions}: backend {backend} ({dev_text}) computed a WRONG result for an 8x8 matmul",
            _jax_fix(ctx, plugins) if on_gpu else 'pip install -U --force-reinstall "jax" "jaxlib"',
        )
    timing = f" (import + test matmul in {probe.data.get('elapsed_s', probe.elapsed_s):.1f} s)"
    if on_gpu:
        note = ""
        try:
            plan = ctx.plan()
            if plan["build"] == "cuda13" and "jax-cuda13-plugin" not in plugins and "jax-cuda12-plugin" in plugins:
                note = "; jax[cuda13] would also run on this driver"
        except _FactError:
            pass
        return res(OK, f"{versions}: backend {backend}, {dev_text}{timing}{note}")
    if gpu:
        cuda_err = (data.get("backend_errors") or {}).get("cuda")
        warn_lines = [w for w in data.get("warnings") or [] if re.search(r"cuda|gpu|plugin", w, re.IGNORECASE)]
        jp = os.environ.get("JAX_PLATFORMS", "").strip()
        if jp and not any(p.strip() in ("cuda", "gpu") for p in jp.split(",")):
            why = f"JAX_PLATFORMS={jp} keeps JAX off the GPU"
        elif cuda_err or any("failed to initialize" in w or "Unable to initialize" in w for w in warn_lines):
            why = "the CUDA plugin failed to initialise: " + _first_relevant_line(cuda_err or "", *warn_lines)
        elif not any(k.startswith("jax-cuda") for k in plugins) and "+cuda" not in (jaxlib_v or ""):
            why = "jaxlib is CPU-only (no jax-cuda plugin installed)"
        else:
            what = "the CUDA plugin" if plugins else f"the CUDA jaxlib ({jaxlib_v})"
            why = f"{what} is installed but not used" + (": " + _first_relevant_line(*warn_lines) if warn_lines else "")
        if mismatched:
            why += f" (plugin versions {', '.join(mismatched)} differ from jaxlib {jaxlib_v})"
        return res(FAIL, f"{versions}: JAX runs on {backend} although an NVIDIA GPU is present: {why}", _jax_fix(ctx, plugins))
    if ctx.require_gpu:
        return res(
            FAIL,
            f"{versions}: backend {backend} and no GPU on this machine, but --require-gpu was given",
            "run on a GPU pod (then install the JAX build this doctor recommends there)",
        )
    return res(OK, f"{versions}: backend {backend} ({dev_text}); no GPU on this machine{timing}")


JAX = Check("jax", "JAX backend", _check_jax)
