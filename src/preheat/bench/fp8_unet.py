"""A whole UNet's denoising step with plain fp8 weights on the local devices: the fp8 1x1 convs as
GEMMs on the fp8 weight against XLA's convolution on a bf16 copy, and the same weights in bf16 (the
GPU check's ``fp8unet`` row, ``scripts/gpu_measure.py``).

Last round's deviceless H200 HLO (``scripts/bench_fp8_unet.py``; docs/benchmarks.md, "fp8three")
has each plain fp8 1x1 conv as one kernel instead of two, but the whole UNet writing 0.2-0.8% more
bytes (split-K GEMMs at 16² and 8²). Only an autotuned compile on the GPU, timed, says which is
faster; this module is that measurement. Three programs of the same step, compiled here (on a GPU:
autotuned), the weights made in this process (random bytes on the host, placed on the device; nothing
read or downloaded):

    gemm   fp8 weights where a ``weights_dtype="float8_e4m3fn"`` load puts them, the 1x1 convs as
           GEMMs on the fp8 weight (``PREHEAT_FP8_1X1=gemm``, preheat's default)
    conv   the same fp8 weights, the 1x1 convs converted by ``storage.upcast`` and run as XLA's
           convolution (``PREHEAT_FP8_1X1=conv``: the path before)
    bf16   the control: the same values stored in bf16 (fp8 -> bf16 is exact), no fp8 anywhere

The switch is the one ``storage._pointwise_conv`` reads while a program is traced
(``preheat.models.conv.fp8_1x1_impl``); each program is traced under its own setting, and the
count of convolutions in each program's jaxpr shows it took (``conv`` has one more per fp8 1x1
conv than ``gemm``).

A step is what the sampler runs: the denoiser's apply (``LoadedUNet2DCondition.apply``:
``storage.upcast`` with the step's tie, then the UNet) on CFG's batch of 2 for one image, the
guided prediction, an Euler update. ``steps`` of them run in one program (a loop, as the sampling
loop is, so that each step converts its weights and dispatch is not timed); ms/step is a call's
time over its steps. The three calls alternate, ``rounds`` rounds after an untimed one each.

    measure_unet(model, size)    -> {"ways": {gemm, conv, bf16: ms/step, compile s, counts},
                                     "gemm_over_conv": per-round ratios, "verdict", "agreement"}
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import time
from typing import Any, Iterator, NamedTuple

from preheat.bench.common import equations
from preheat.bench.random_models import SD15_UNET, SDXL_UNET

__all__ = ["UNETS", "TINY_UNETS", "WAYS", "AGREE_RATIO", "AGREE_FLOOR", "measure_unet", "verdict", "agreement"]


class UNetCase(NamedTuple):
    """One UNet of the row: its published config and the latent side of its native resolution."""

    title: str
    config: dict[str, Any]
    latent: int  # latent side (image side / 8)
    pooled: int = 0  # SDXL's pooled text width ("text_time"); 0 without it


UNETS = {"sd15": UNetCase("SD 1.5 UNet 512²", SD15_UNET, 64),
         "sdxl": UNetCase("SDXL UNet 1024²", SDXL_UNET, 128, pooled=1280)}
# The dry run's: the same block types and options at a width a CPU compiles in seconds (SD 1.5's
# 1x1 attention projections and conv shortcuts; SDXL's linear projections, conv shortcuts, added ids).
TINY_UNETS = {
    "sd15": UNetCase("SD 1.5 UNet (tiny) 64²", {
        **SD15_UNET, "block_out_channels": (32, 64), "layers_per_block": 1, "norm_num_groups": 8,
        "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
        "cross_attention_dim": 32, "attention_head_dim": 2}, 8),
    "sdxl": UNetCase("SDXL UNet (tiny) 64²", {
        **SDXL_UNET, "block_out_channels": (32, 64), "layers_per_block": 1, "norm_num_groups": 8,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
        "cross_attention_dim": 32, "attention_head_dim": (2, 4), "transformer_layers_per_block": (1, 2),
        "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 32 + 6 * 8}, 8, pooled=32),
}
WAYS = ("gemm", "conv", "bf16")  # PREHEAT_FP8_1X1 for the fp8 ways; bf16 is the control
# Whether the ways agree: each fp8 way's first-step prediction against a float32 reference (the
# same weights, fp8 -> float32 is exact, computed in float32 at "highest" matmul precision, not
# timed), as mean |Δ| over the reference's mean |prediction|, next to the bf16 control's own. The
# fp8 ways are the same values and the same math in bf16, so each must be about as close as the
# control: at most AGREE_RATIO times its error plus AGREE_FLOOR. The guided prediction multiplies
# the halves' difference by the guidance (7.5), and bf16's rounding with it: the control's own
# error, on this CPU, is 10.8% (SD 1.5's tiny UNet) and 5.8% (SDXL's). A wrong weight or a skipped
# layer gives O(1) (predictions of unrelated weights are uncorrelated). Round 11 bounded the three
# ways' distances from each other instead (2%, from CPU runs where they are bit-identical): on
# the H200 three autotuned compiles of this random SD 1.5 UNet were ~9% apart, the pair that
# does not involve the GEMM path too, so that bound singled out no path (docs/gpu.md).
AGREE_RATIO = 2.0
AGREE_FLOOR = 0.005


@contextlib.contextmanager
def _setting(value: str | None) -> Iterator[None]:
    """``PREHEAT_FP8_1X1`` set to ``value`` (None: unset) while a program is traced, then restored."""
    old = os.environ.get("PREHEAT_FP8_1X1")
    try:
        if value is None:
            os.environ.pop("PREHEAT_FP8_1X1", None)
        else:
            os.environ["PREHEAT_FP8_1X1"] = value
        yield
    finally:
        if old is None:
            os.environ.pop("PREHEAT_FP8_1X1", None)
        else:
            os.environ["PREHEAT_FP8_1X1"] = old


def _random_weights(abstract: Any, plan: Any, seed: int) -> tuple[Any, Any]:
    """(fp8 state, bf16 state) on the default device: each kernel's values spread evenly over
    ±1/sqrt(fan_in) (torch's default range), biases ±0.02, norm scales 1 ± 0.1, picked by random
    bytes from 256 levels (rounded to the stored dtype: fp8 where the plan says so); the bf16 state
    holds exactly the same values in bf16. Made on the host from random bytes and a table, then
    placed: no compile (a random generator per leaf in one program took a minute to compile even
    for the dry run's tiny UNet), about 3 ns an element (SDXL's 2.6 B: seconds)."""
    import math

    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    from flax import nnx

    from preheat.models.weights import torch_key

    rng = np.random.default_rng(seed)
    flat = list(nnx.to_flat_state(abstract))
    low, full = [], []
    for path, var in flat:
        shape, leaf = tuple(var.shape), str(path[-1])
        bound = 1 / math.sqrt(max(1, math.prod(shape[:-1])))
        lo, hi = {"kernel": (-bound, bound), "embedding": (-bound, bound), "scale": (0.9, 1.1)}.get(leaf, (-0.02, 0.02))
        want = np.dtype(jnp.dtype(plan(torch_key(path))))
        table = np.linspace(lo, hi, 256, dtype=np.float32).astype(want)  # the 256 levels, in the stored dtype
        picks = np.frombuffer(rng.bytes(math.prod(shape)), np.uint8).reshape(shape)
        low.append(jax.device_put(np.take(table, picks)))
        full.append(jax.device_put(np.take(table.astype(ml_dtypes.bfloat16), picks)))  # the same values
    return (nnx.from_flat_state([(p, v.replace(x)) for (p, v), x in zip(flat, low)]),
            nnx.from_flat_state([(p, v.replace(x)) for (p, v), x in zip(flat, full)]))


def _counts(program: Any, jaxpr: Any) -> dict[str, int]:
    """The convolutions in the traced program (jaxpr, sub-jaxprs included) and what XLA compiled:
    cuDNN convolution calls and XLA convolution ops, cuBLAS calls and Triton GEMM fusions."""
    def convs(j: Any) -> int:
        return sum(eqn.primitive.name == "conv_general_dilated" for eqn in equations(j))

    hlo = program.as_text()
    return {"traced_convs": convs(jaxpr), "cudnn_convs": len(re.findall(r'custom_call_target="__cudnn\$conv', hlo)),
            "xla_convs": len(re.findall(r"\bconvolution\(", hlo)),
            "cublas_calls": len(re.findall(r'custom_call_target="__cublas', hlo)),
            "triton_gemms": len(re.findall(r'"kind":"__triton_gemm"', hlo))}


def verdict(ratios: list[float]) -> str:
    """``faster`` when the GEMM path won every round (gemm/conv < 1 in each: a sign test, p = 2^-n
    under no difference), ``slower`` when it lost every round, else ``within noise``."""
    if ratios and max(ratios) < 1:
        return "faster"
    if ratios and min(ratios) > 1:
        return "slower"
    return "within noise"


def measure_unet(model: str = "sd15", size: str = "full", steps: int = 10, rounds: int = 10, guidance: float = 7.5,
                 seed: int = 0) -> dict[str, Any]:
    """The three ways of ``UNETS[model]`` (``TINY_UNETS`` for ``size="tiny"``) at batch 1 with CFG,
    compiled on the local devices: per way the compile seconds, the convolution counts, ms per
    step (median/min/max over ``rounds``); the per-round gemm/conv ratios and their verdict; and
    how close each way's first step is to a float32 reference (``agreement``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from preheat.models import storage
    from preheat.models.quantised import FLOAT8
    from preheat.models.unet2d_condition import LoadedUNet2DCondition, UNet2DConditionConfig, build_abstract
    from preheat.models.weights import LoadOptions, dtype_plan
    from preheat.platforms import describe_device

    case = (TINY_UNETS if size == "tiny" else UNETS)[model]
    cfg = UNet2DConditionConfig.from_dict(case.config)
    graph, abstract = build_abstract(cfg)
    plan = dtype_plan(abstract, jnp.bfloat16, options=LoadOptions(weights_dtype=FLOAT8),
                      low=storage.layerwise(("norm",)))  # as unet2d_condition's loader asks
    start = time.perf_counter()
    fp8, bf16 = _random_weights(abstract, plan, seed)
    jax.block_until_ready((fp8, bf16))
    weights_s = time.perf_counter() - start
    unet = LoadedUNet2DCondition(config=cfg, graphdef=graph, params=bf16, dtype=jnp.bfloat16)
    pointwise = sum(1 for path, leaf in nnx.to_flat_state(fp8)  # the kernels the switch moves
                    if str(path[-1]) == "kernel" and tuple(leaf.shape[:2]) == (1, 1)
                    and leaf.dtype == jnp.float8_e4m3fn)

    rng = np.random.default_rng(seed)
    h = w = case.latent
    x0 = jnp.asarray(rng.standard_normal((1, h, w, cfg.in_channels)), jnp.bfloat16)  # (1, H, W, 4): one image
    ctx = jnp.asarray(rng.standard_normal((2, 77, cfg.cross_attention_dim)), jnp.bfloat16)  # (2, 77, D): cond, uncond
    added = ({"text_embeds": jnp.asarray(rng.standard_normal((2, case.pooled)), jnp.bfloat16),
              "time_ids": jnp.asarray(np.tile([case.latent * 8, case.latent * 8, 0, 0, case.latent * 8,
                                               case.latent * 8], (2, 1)), jnp.float32)}
             if cfg.addition_embed_type == "text_time" else None)

    def make_program(unet: Any = unet) -> Any:  # a fresh function per way: traced under that way's setting
        def run(params: Any, x: Any, ctx: Any, added: Any, n: Any) -> tuple[Any, Any]:
            def step(i: Any, carry: Any) -> Any:  # one denoising step: CFG's batch of 2, Euler
                x, _ = carry
                t = jnp.full((2,), 999.0, jnp.float32) - 50.0 * i  # (2,)
                eps2 = unet.apply(params, jnp.concatenate([x, x]), t, ctx, added)  # (2, H, W, 4)
                eps = eps2[1:] + guidance * (eps2[:1] - eps2[1:])  # uncond + g (cond - uncond)
                return (x - 0.05 * eps).astype(x.dtype), eps.astype(x.dtype)

            return jax.lax.fori_loop(0, n, step, (x, jnp.zeros_like(x)))  # n: data, one program for 1 and steps
        return run

    out: dict[str, Any] = {"model": model, "title": case.title, "size": size, "latent": case.latent, "batch": 1,
                           "cfg_batch": 2, "steps_per_call": steps, "rounds": rounds,
                           **describe_device(),
                           "params": sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(abstract)),
                           "fp8_params": sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(fp8)
                                             if v.dtype == jnp.float8_e4m3fn),
                           "fp8_pointwise_convs": pointwise, "weights_s": weights_s, "ways": {}}
    programs, first = {}, {}
    one, many = jnp.int32(1), jnp.int32(steps)
    for way in WAYS:
        params = bf16 if way == "bf16" else fp8
        args = (params, x0, ctx, added)
        with _setting(None if way == "bf16" else way):
            start = time.perf_counter()
            traced = jax.jit(make_program()).trace(*args, one)
            compiled = traced.lower().compile()  # on a GPU: autotuned, here
        compile_s = time.perf_counter() - start  # trace + lower + compile
        programs[way] = (compiled, args)
        first[way] = np.asarray(compiled(*args, one)[1], np.float32)  # the first step's guided prediction
        out["ways"][way] = {"compile_s": compile_s, **_counts(compiled, traced.jaxpr.jaxpr)}
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for way, (compiled, args) in programs.items():  # untimed: first-execution work
        jax.block_until_ready(compiled(*args, many))
    for _ in range(rounds):
        for way, (compiled, args) in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args, many))
            times[way].append((time.perf_counter() - start) * 1e3 / steps)
    for way in WAYS:
        t = times[way]
        out["ways"][way]["ms_per_step"] = {"median": statistics.median(t), "min": min(t), "max": max(t), "n": len(t)}
    ratios = [a / b for a, b in zip(times["gemm"], times["conv"])]  # the same round: drift moves both
    out["gemm_over_conv"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    out["fp8_gemm_over_bf16"] = statistics.median(times["gemm"]) / statistics.median(times["bf16"])
    out["verdict"] = verdict(ratios)
    # the float32 reference: the same values (bf16 holds the fp8 ones exactly), float32 throughout
    f32_params, f32_x, f32_ctx, f32_added = jax.tree.map(lambda a: a.astype(jnp.float32), (bf16, x0, ctx, added))
    reference_unet = LoadedUNet2DCondition(config=cfg, graphdef=graph, params=f32_params, dtype=jnp.float32)
    with jax.default_matmul_precision("highest"):
        program = jax.jit(make_program(reference_unet))
        reference = np.asarray(program(f32_params, f32_x, f32_ctx, f32_added, one)[1], np.float32)
    out["agreement"] = agreement(first, reference)
    return out


def agreement(first: dict[str, Any], reference: Any) -> dict[str, Any]:
    """Each way's first-step prediction against the float32 ``reference`` (mean and max |Δ| over
    its mean |prediction|), and ``ok``: all finite and each fp8 way within AGREE_RATIO times the
    bf16 control's error plus AGREE_FLOOR (``AGREE_RATIO``'s comment says why)."""
    import numpy as np

    scale = max(float(np.mean(np.abs(reference))), 1e-30)
    errors = {way: {"mean": float(np.mean(np.abs(p - reference))) / scale,
                    "max": float(np.max(np.abs(p - reference))) / scale} for way, p in first.items()}
    finite = bool(np.isfinite(reference).all() and all(np.isfinite(p).all() for p in first.values()))
    bound = AGREE_RATIO * errors["bf16"]["mean"] + AGREE_FLOOR
    return {"ratio": AGREE_RATIO, "floor": AGREE_FLOOR, "finite": finite, "mean_abs_reference": scale,
            "error_vs_float32": errors, "bound": bound,
            "ok": finite and all(errors[way]["mean"] <= bound for way in first if way != "bf16")}
