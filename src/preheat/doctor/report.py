"""Running everything: gather the facts, run every registered check, build the ``Report``."""

from __future__ import annotations

import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from preheat.doctor import dists
from preheat.doctor.checks import checks_for
from preheat.doctor.context import Context, ModelRequest, _FactError
from preheat.doctor.probe import ProbeResult, _run_probe
from preheat.doctor.results import _STATUS_ORDER, FAIL, CheckResult, Report
from preheat.doctor.smi import _dev_nodes, _query_nvidia_smi
from preheat.doctor.tpu_host import _tpu_host

TPU_PROBE_TIMEOUT_S = 60.0  # the TPU runtime's own start takes seconds (9 s for preheat's whole first load on a v5e)

def _gather(ctx: Context) -> None:
    """nvidia-smi and the TPU host first (so the probes' own CUDA contexts or TPU chips never count
    as "other processes"), then the JAX and torch probes side by side."""
    ctx.gather("dev", _dev_nodes)
    ctx.gather("smi", lambda: _query_nvidia_smi(ctx.smi_timeout))
    ctx.gather("tpu", _tpu_host)
    if ctx.platform() == "tpu" and not os.environ.get("PREHEAT_DOCTOR_TIMEOUT", "").strip():
        ctx.probe_timeout = max(ctx.probe_timeout, TPU_PROBE_TIMEOUT_S)

    def jax_probe() -> ProbeResult:
        if not os.environ.get("PREHEAT_DOCTOR_JAX_PROBE") and dists._dist_version("jax") is None:
            return ProbeResult("skipped")
        return _run_probe("PREHEAT_DOCTOR_JAX_PROBE", "preheat.doctor.jax_probe", ctx.probe_timeout)

    def torch_probe() -> ProbeResult:
        if not os.environ.get("PREHEAT_DOCTOR_TORCH_PROBE") and dists._dist_version("torch") is None:
            return ProbeResult("skipped")
        return _run_probe("PREHEAT_DOCTOR_TORCH_PROBE", "preheat.doctor.torch_probe", ctx.probe_timeout)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {"jax_probe": pool.submit(jax_probe), "torch_probe": pool.submit(torch_probe)}
        for name, fut in futures.items():
            ctx.gather(name, fut.result)


def _versions(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
    }
    for name in ("preheat", "jax", "jaxlib", "torch", "numpy", "flax", "libtpu"):
        out[name] = dists._dist_version(name)
    try:
        out["jax_plugins"] = dists._jax_gpu_plugins()
    except Exception:
        out["jax_plugins"] = {}
    try:
        smi = ctx.smi
        out["nvidia_driver"] = smi.driver
        out["cuda_driver_supports"] = smi.cuda
    except _FactError:
        out["nvidia_driver"] = out["cuda_driver_supports"] = None
    try:
        tpu = ctx.tpu
        out["tpu"] = {"generation": tpu.generation, **tpu.env} if tpu.is_tpu else None
    except _FactError:
        out["tpu"] = None
    for probe_name, key in (("jax_probe", "jax_backend"), ("torch_probe", "torch_cuda")):
        try:
            data = ctx.fact(probe_name).data
            out[key] = data.get("backend") if key == "jax_backend" else data.get("cuda_build")
        except (_FactError, KeyError):
            out[key] = None
    return out


def run_checks(require_gpu: bool = False, model: ModelRequest | None = None) -> Report:
    """Run the checks that apply on this machine (``checks_for``); never raises. A check that
    raises is reported as ``fail`` with its error."""
    t0 = time.monotonic()
    ctx = Context(require_gpu=require_gpu, model=model)
    _gather(ctx)
    results: list[CheckResult] = []
    for registered in checks_for(ctx.platform()):
        check_id, title = registered.id, registered.title
        try:
            if registered.applies is not None and not registered.applies(ctx):
                continue
            result = registered.run(ctx)
            if result.status not in _STATUS_ORDER:
                raise ValueError(f"check returned unknown status {result.status!r}")
        except Exception as exc:
            what = str(exc) if isinstance(exc, _FactError) else f"the check itself raised {type(exc).__name__}: {exc}"
            result = CheckResult(
                check_id,
                title,
                FAIL,
                what,
                "this is a bug in preheat doctor: report it with the output of `preheat doctor --json`",
                {"error": f"{type(exc).__name__}: {exc}"},
            )
        results.append(result)
    try:
        versions = _versions(ctx)
    except Exception as exc:
        versions = {"error": f"{type(exc).__name__}: {exc}"}
    report = Report(results, versions, require_gpu=require_gpu, gpu_backend=ctx.gpu_backend)
    if require_gpu and ctx.gpu_backend is not True:
        jax_check = next((c for c in results if c.id == "jax"), None)
        if jax_check is not None and jax_check.status != FAIL:  # say why the exit code is 1
            jax_check.status = FAIL
            jax_check.finding += "; --require-gpu: no GPU backend in use"
            jax_check.fix = jax_check.fix or "run on a GPU pod"
    report.elapsed_s = time.monotonic() - t0
    return report
