"""``preheat doctor --model MODEL``: do the model's weights fit one device at the requested dtype?

The weights' bytes come from the safetensors headers (``preheat.models.footprint``; no weight is
read), the device's memory from the JAX probe (``memory_stats()["bytes_limit"]``: a TPU chip's HBM,
a GPU's allocator limit) or nvidia-smi. When they do not fit, the finding says by how much and the
fix names the first option that does: bfloat16, fp8 weights, text encoders in host memory.
"""

from __future__ import annotations

from typing import Any

from preheat.doctor.context import Context, _FactError
from preheat.doctor.results import FAIL, OK, WARN, Check, CheckResult
from preheat.errors import PreheatError

_ROOM = 0.75  # weights above this share leave little for activations (SDXL 1024² in float32: 82% of a v5e chip)
FP8 = "float8_e4m3fn"
DTYPES = ("float32", "bfloat16", "float16")  # cli.options.DTYPES, without importing the CLI's JAX side


def _limit(ctx: Context) -> tuple[int | None, str]:
    """(bytes one device holds, what they are called) -- None where there is no accelerator."""
    platform = ctx.platform()
    probe = ctx.fact("jax_probe")
    data = probe.data if probe.status == "ok" and probe.data.get("ok") else {}
    limit = (data.get("device") or {}).get("bytes_limit")
    if platform == "tpu":
        return limit, "HBM of one TPU chip"
    if platform == "gpu":
        if not limit:
            try:
                mib = next((g.memory_mib for g in ctx.smi.gpus if g.memory_mib), None)
                limit = mib * 2**20 if mib else None
            except _FactError:
                limit = None
        return limit, "memory of one GPU"
    return None, ""


def _resolve(model: str, variant: str | None) -> Any:
    from preheat.store import resolve

    return resolve(model, variant=variant, offline=True, progress=False)  # doctor never downloads


def _check_model_fit(ctx: Context) -> CheckResult:
    from preheat.models.footprint import gib, weight_footprint

    req = ctx.model
    assert req is not None
    details: dict[str, Any] = {"model": req.model, "dtype": req.dtype, "weights_dtype": req.weights_dtype}

    def res(status: str, finding: str, fix: str | None = None) -> CheckResult:
        return CheckResult("model_fit", "Model fit", status, finding, fix, details)

    try:
        root = _resolve(req.model, req.variant)
        fp = weight_footprint(root, req.dtype, variant=req.variant, weights_dtype=req.weights_dtype,
                              offload_encoders=req.offload_encoders)
    except PreheatError as exc:
        return res(FAIL, f"cannot size {req.model}: {exc}", "give a diffusers folder, or `preheat pull` the source first")
    details.update(parts=fp.parts, offloaded=fp.offloaded, total=fp.total)
    parts = ", ".join(f"{name} {gib(n)}" for name, n in sorted(fp.parts.items(), key=lambda kv: -kv[1]))
    weights = f"{gib(fp.total)} of weights at {fp.options()} ({parts})"
    limit, what = _limit(ctx)
    details["bytes_limit"] = limit
    if not limit:
        return res(OK, f"{weights}; no accelerator memory to compare with (the weights go to host memory)")
    share = fp.total / limit
    if share <= _ROOM:
        return res(OK, f"{weights}: {share:.0%} of the {gib(limit)} {what}")
    fits = _alternative(root, req, limit)
    over = f"{gib(fp.total - limit)} more than" if fp.total > limit else f"{share:.0%} of"
    finding = f"{weights}: {over} the {gib(limit)} {what}"
    if fp.total <= limit:
        finding += ", little room left for activations and compiled programs"
    fix = f"load with {fits}" if fits else "no single-device option fits: shard the weights over devices (preheat.load(..., fsdp=N))"
    return res(FAIL if fp.total > limit else WARN, finding, fix)


def _alternative(root: Any, req: Any, limit: int) -> str | None:
    """The first load option, cheapest to quality first, whose weights fit with room."""
    from preheat.models.footprint import gib, weight_footprint

    dtype = req.dtype if req.dtype != "float32" else "bfloat16"
    tries = [(dtype, req.weights_dtype, req.offload_encoders), (dtype, FP8, req.offload_encoders),
             (dtype, req.weights_dtype, True), (dtype, FP8, True)]
    seen = set()
    for dt, wd, off in tries:
        if (dt, wd, off) in seen or (dt, wd, off) == (req.dtype, req.weights_dtype, req.offload_encoders):
            continue
        seen.add((dt, wd, off))
        try:
            fp = weight_footprint(root, dt, variant=req.variant, weights_dtype=wd, offload_encoders=off)
        except PreheatError:
            return None
        if fp.total <= _ROOM * limit and (not off or fp.offloaded):
            return f"{fp.options()} ({gib(fp.total)}, about {fp.total / limit:.0%})"
    return None


MODEL_FIT = Check("model_fit", "Model fit", _check_model_fit, applies=lambda ctx: ctx.model is not None)
