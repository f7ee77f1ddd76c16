"""Check 1: the accelerator -- is there an NVIDIA GPU, does its driver answer, and which JAX build
fits it."""

from __future__ import annotations

from typing import Any

from preheat.doctor.context import _DRIVER_FIX, DRIVER_MIN_CUDA12, DRIVER_MIN_CUDA13, Context, _pip_jax, _sm
from preheat.doctor.results import FAIL, OK, WARN, Check, CheckResult
from preheat.doctor.runner import _fmt_s

def _check_accelerator(ctx: Context) -> CheckResult:
    title = "Accelerator"
    dev, smi = ctx.dev, ctx.smi
    details: dict[str, Any] = {
        "dev_root": dev["root"][0],
        "dev_nodes": dev["all"],
        "nvidia_smi": smi.path,
        "nvidia_smi_status": smi.status,
        "driver": smi.driver,
        "cuda_driver_supports": smi.cuda,
        "gpus": [
            {"index": g.index, "name": g.name, "memory_mib": g.memory_mib, "compute_cap": _sm(g.compute_cap) if g.compute_cap else None}
            for g in smi.gpus
        ],
    }

    def res(status: str, finding: str, fix: str | None = None) -> CheckResult:
        return CheckResult("accelerator", title, status, finding, fix, details)

    nodes = dev["gpus"]
    if smi.status == "missing":
        if not nodes:
            return res(OK, f"no NVIDIA GPU: no {dev['root'][0]}/nvidia* device nodes and no nvidia-smi on PATH; JAX and torch run on CPU")
        return res(
            WARN,
            f"{len(nodes)} GPU device node(s) ({', '.join(nodes)}) but nvidia-smi is not on PATH: cannot read the driver version",
            "start the container with the NVIDIA runtime's utility capability (docker run --gpus all, or "
            "NVIDIA_DRIVER_CAPABILITIES=compute,utility), or add nvidia-smi's folder to PATH",
        )
    if smi.status == "timeout":
        return res(
            FAIL,
            f"nvidia-smi did not answer within {_fmt_s(ctx.smi_timeout)}: the driver or GPU is hung",
            "restart the pod; if nvidia-smi still hangs the host GPU is faulty: move to another machine",
        )
    if smi.status == "error":
        if not nodes:
            return res(
                WARN,
                f"nvidia-smi is installed but fails ({smi.error}) and there are no {dev['root'][0]}/nvidia* device nodes: "
                "no GPU is visible in this container",
                "if this pod should have a GPU, redeploy it with a GPU (docker run --gpus all); otherwise ignore",
            )
        return res(
            FAIL,
            f"nvidia-smi fails: {smi.error}",
            "restart the pod; if it persists the host's driver is broken: redeploy on another machine",
        )
    if not smi.gpus:
        return res(WARN, "nvidia-smi runs but lists no GPUs", "redeploy the pod with a GPU attached (docker run --gpus all)")

    counts: dict[str, int] = {}
    for g in smi.gpus:
        counts[g.name] = counts.get(g.name, 0) + 1
    g0 = smi.gpus[0]
    mem = f"{g0.memory_mib} MiB" if g0.memory_mib is not None else "memory unknown"
    sm = smi.min_sm
    sm_text = f"SM {_sm(sm)}" if sm else ("SM unknown: this nvidia-smi has no compute_cap field" if not smi.compute_cap_supported else "SM unknown")
    gpus_text = ", ".join(f"{n}x {name}" for name, n in counts.items())
    cuda = f" (supports CUDA <= {smi.cuda})" if smi.cuda else ""
    base = f"{gpus_text} ({mem}, {sm_text}); driver {smi.driver or 'unknown'}{cuda}"
    plan = ctx.plan()
    details["recommended_jax"] = f"jax[{plan['build']}]" if plan["build"] else None

    if not nodes:
        return res(
            WARN,
            f"{base}; but no {dev['root'][0]}/nvidia[0-9]* device nodes: CUDA programs cannot open the GPU",
            "redeploy/restart the container with the GPU attached (docker run --gpus all)",
        )
    if plan["why"] == "driver unknown":
        return res(WARN, f"{base}; cannot tell which JAX build fits", "check the driver with `nvidia-smi`; jax[cuda12] needs >= 525, jax[cuda13] >= 580")
    if plan["why"] == "driver too old":
        return res(
            FAIL,
            f"{base}: driver {plan['driver_major']} is too old for any JAX GPU build "
            f"(jax[cuda12] needs >= {DRIVER_MIN_CUDA12}, jax[cuda13] needs >= {DRIVER_MIN_CUDA13})",
            _DRIVER_FIX,
        )
    if plan["why"] == "gpu too old":
        return res(
            FAIL,
            f"{base}: no JAX GPU build supports SM {_sm(sm)} (CUDA 12 builds need SM >= 5.2, CUDA 13 builds SM >= 7.5)",
            "use a newer GPU (SM >= 7.5 runs both builds)",
        )
    if plan["why"] == "gpu too old for cuda13":
        return res(
            WARN,
            f"{base}: the driver allows jax[cuda13] but CUDA 13 builds need SM >= 7.5; this GPU (SM {_sm(sm)}) needs jax[cuda12] "
            "(CUDA 12 builds support SM >= 5.2)",
            _pip_jax("cuda12"),
        )
    if plan["build"] == "cuda13":
        return res(OK, f"{base} -> use jax[cuda13] (CUDA 13 builds support SM >= 7.5; jax[cuda12] also runs on this driver)")
    return res(OK, f"{base} -> use jax[cuda12] (CUDA 12 builds support SM >= 5.2; jax[cuda13] needs driver >= {DRIVER_MIN_CUDA13})")


ACCELERATOR = Check("accelerator", "Accelerator", _check_accelerator)
