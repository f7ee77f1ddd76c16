"""``preheat doctor --model MODEL``: do the model's weights fit one device at the requested dtype?

The weights' bytes come from the safetensors headers (``preheat.models.footprint``; no weight is
read), the device's memory from the JAX probe (``memory_stats()["bytes_limit"]``: a TPU chip's HBM,
a GPU's allocator limit) or nvidia-smi. When they do not fit, the finding says by how much and the
fix names the first option that does: bfloat16, 8-bit denoiser weights (int8 first on a TPU), every
Linear in 8 bits, text encoders in host memory, text encoders run on the host's CPU (``--encoders-on
host``: FLUX.1-dev on a TPU v5e). ``details["plan"]``: what goes where, a line per
component, printed under the table (``footprint.Footprint.plan``); offloaded encoders count while
prompts are encoded, when the encode stage moves them in beside everything else.
"""

from __future__ import annotations

from typing import Any

from preheat.doctor.context import Context, _FactError
from preheat.doctor.results import FAIL, OK, WARN, Check, CheckResult
from preheat.errors import PreheatError

FP8 = "float8_e4m3fn"
INT8 = "int8"
WEIGHTS_DTYPES = (INT8, FP8)  # footprint.WEIGHTS_DTYPES
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
    from preheat.models.footprint import fitting, gib, weight_footprint

    req = ctx.model
    assert req is not None
    details: dict[str, Any] = {"model": req.model, "dtype": req.dtype, "weights_dtype": req.weights_dtype,
                               "weights_layers": req.weights_layers, "encoders_on": req.encoders_on}

    def res(status: str, finding: str, fix: str | None = None) -> CheckResult:
        return CheckResult("model_fit", "Model fit", status, finding, fix, details)

    try:
        root = _resolve(req.model, req.variant)
        fp = weight_footprint(root, req.dtype, variant=req.variant, weights_dtype=req.weights_dtype,
                              weights_layers=req.weights_layers, offload_encoders=req.offload_encoders,
                              encoders_on=req.encoders_on)
    except PreheatError as exc:
        return res(FAIL, f"cannot size {req.model}: {exc}", "give a diffusers folder, or `preheat pull` the source first")
    limit, what = _limit(ctx)
    details.update(parts=fp.parts, offloaded=fp.offloaded, host=fp.host, total=fp.total, peak=fp.peak, bytes_limit=limit,
                   plan=fp.plan(limit, f"the {what}" if limit else "the device"))
    parts = ", ".join(f"{name} {gib(n)}" for name, n in sorted(fp.parts.items(), key=lambda kv: -kv[1]))
    weights = f"{gib(fp.total)} of weights at {fp.options()} ({parts})"
    if not limit:
        return res(OK, f"{weights}; no accelerator memory to compare with (the weights go to host memory)")
    if fp.fits(limit):
        encode = f"; {gib(fp.peak)} while prompts are encoded" if fp.offloaded else ""
        encode += f"; {gib(sum(fp.host.values()))} of text encoders run on the host" if fp.host else ""
        return res(OK, f"{weights}: {fp.total / limit:.0%} of the {gib(limit)} {what}{encode}")
    try:
        alt = fitting(root, limit, dtype=req.dtype, variant=req.variant, weights_dtype=req.weights_dtype,
                      weights_layers=req.weights_layers, offload_encoders=req.offload_encoders,
                      prefer=INT8 if ctx.platform() == "tpu" else FP8, encoders_on=req.encoders_on)
    except PreheatError:
        alt = None
    if fp.total > limit:
        finding = f"{weights}: {gib(fp.total - limit)} more than the {gib(limit)} {what}"
    elif fp.peak > limit:
        offloaded = ", ".join(f"{name} {gib(n)}" for name, n in fp.offloaded.items())
        finding = (f"{weights}, and {offloaded} moved in while prompts are encoded: {gib(fp.peak)}, "
                   f"{gib(fp.peak - limit)} more than the {gib(limit)} {what}")
    else:
        finding = (f"{weights}: {fp.total / limit:.0%} of the {gib(limit)} {what}, little room left for activations "
                   "and compiled programs")
    if alt:
        fix = f"load with {alt.options()} ({gib(alt.total)}, about {alt.total / limit:.0%})"
        if alt.offloaded:
            fix = fix[:-1] + f"; {gib(alt.peak)} while prompts are encoded)"
        if alt.host:
            fix = fix[:-1] + f"; the text encoders, {gib(sum(alt.host.values()))}, in host memory and run there)"
    else:
        fix = "no single-device option fits: shard the weights over devices (preheat.load(..., fsdp=N))"
        try:
            rest = fp if fp.fits(limit, encoding=False) else fitting(
                root, limit, dtype=req.dtype, variant=req.variant, weights_dtype=req.weights_dtype,
                weights_layers=req.weights_layers, offload_encoders=req.offload_encoders,
                prefer=INT8 if ctx.platform() == "tpu" else FP8, encoding=False, encoders_on=req.encoders_on)
        except PreheatError:
            rest = None
        if rest is not None:  # FLUX.1-dev on a v5e: the int8 transformer fits, T5-XXL beside it does not
            fix = (f"with {rest.options()} the weights fit while denoising ({gib(rest.total)}, about "
                   f"{rest.total / limit:.0%}), but not while prompts are encoded ({gib(rest.peak)}): the text "
                   "encoders must run off this device, or " + fix.split(": ", 1)[1])
    return res(FAIL if fp.peak > limit else WARN, finding, fix)


MODEL_FIT = Check("model_fit", "Model fit", _check_model_fit, applies=lambda ctx: ctx.model is not None)
