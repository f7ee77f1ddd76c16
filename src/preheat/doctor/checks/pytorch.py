"""Check 3: PyTorch -- is it a CUDA build, and does it see and compute on the GPU."""

from __future__ import annotations

import re
from typing import Any

from preheat.doctor import dists
from preheat.doctor.context import _DRIVER_FIX, DRIVER_MIN_CUDA12, DRIVER_MIN_CUDA13, Context, _count, _FactError, torch_index
from preheat.doctor.probe import ProbeResult, _first_relevant_line, _signal_name
from preheat.doctor.results import OK, WARN, Check, CheckResult
from preheat.doctor.runner import _fmt_s

def _torch_index_for(ctx: Context) -> str | None:
    try:
        plan = ctx.plan()
    except _FactError:
        return None
    major = plan.get("driver_major")
    if major is None or major < DRIVER_MIN_CUDA12:
        return None
    return f"{torch_index()}/cu130" if major >= DRIVER_MIN_CUDA13 else f"{torch_index()}/cu128"


def _torch_cuda_fix(ctx: Context) -> str:
    index = _torch_index_for(ctx)
    if index:
        return f"pip install -U --force-reinstall torch --index-url {index}"
    try:
        if ctx.plan()["why"] == "driver too old":
            return _DRIVER_FIX
    except _FactError:
        pass
    return f"pip install -U --force-reinstall torch --index-url {torch_index()}/cu128 (driver >= 525; cu130 needs >= 580)"


def _check_torch(ctx: Context) -> CheckResult:
    title = "PyTorch"
    version = dists._dist_version("torch")
    probe: ProbeResult = ctx.fact("torch_probe")
    details: dict[str, Any] = {"torch": version, "probe": {"status": probe.status, **probe.data}}

    def res(status: str, finding: str, fix: str | None = None) -> CheckResult:
        return CheckResult("torch", title, status, finding, fix, details)

    if probe.status == "skipped":
        return res(OK, "PyTorch is not installed (optional: only the comparison backend needs it)")
    if probe.status == "timeout":
        return res(
            WARN,
            f"torch {version or '?'}: `import torch; torch.cuda.is_available()` did not finish within {_fmt_s(probe.timeout_s)}",
            'run `python -c "import torch; print(torch.cuda.is_available())"` to see where it hangs; '
            "if JAX is fine, reinstall torch: " + _torch_cuda_fix(ctx),
        )
    if probe.status == "crashed":
        return res(
            WARN,
            f"torch {version or '?'}: the torch probe process died ({_signal_name(probe.rc)}): {_first_relevant_line(probe.stderr) or 'no output'}",
            _torch_cuda_fix(ctx),
        )
    data = probe.data
    if not data.get("ok"):
        return res(WARN, f"torch {version or '?'} fails to import: {_first_relevant_line(data.get('error') or '')}", _torch_cuda_fix(ctx))

    v = data.get("version") or version
    cuda_build = data.get("cuda_build")
    available = bool(data.get("cuda_available"))
    gpu = ctx.gpu_present()
    build = f"CUDA {cuda_build} build" if cuda_build else ("ROCm build" if data.get("hip_build") else "CPU build")
    warn_line = _first_relevant_line(*(data.get("warnings") or []))
    if available:
        devices = ", ".join(f"{n}x {k}" for k, n in _count(data.get("devices") or []).items())
        if data.get("compute_error") or data.get("result_ok") is False:
            err = data.get("compute_error") or "wrong result for an 8x8 matmul"
            return res(WARN, f"torch {v} ({build}) sees {devices} but cannot compute on it: {_first_relevant_line(err)}", _torch_cuda_fix(ctx))
        if warn_line and re.search(r"not compatible|capability", warn_line, re.IGNORECASE):
            return res(WARN, f"torch {v} ({build}) sees {devices} but warns: {warn_line}", _torch_cuda_fix(ctx))
        return res(OK, f"torch {v} ({build}): torch.cuda.is_available() is True, {devices}")
    if cuda_build:
        reason = f": {warn_line}" if warn_line else ""
        if gpu:
            return res(WARN, f"torch {v} is a {build} but torch.cuda.is_available() is False although a GPU is present{reason}", _torch_cuda_fix(ctx))
        return res(
            WARN,
            f"torch {v} is a {build} with no usable GPU (torch.cuda.is_available() is False; no GPU on this machine){reason}",
            f"nothing to fix on a GPU pod; on a CPU-only machine the CPU build is smaller: pip install -U --force-reinstall torch --index-url {torch_index()}/cpu",
        )
    if gpu:
        return res(WARN, f"torch {v} is a {build}: the torch side runs on CPU although a GPU is present", _torch_cuda_fix(ctx))
    return res(OK, f"torch {v} ({build}); no GPU on this machine")


TORCH = Check("torch", "PyTorch", _check_torch)
