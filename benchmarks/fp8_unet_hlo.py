"""The kernels one full-size SD 1.5 or SDXL UNet call compiles to with ``weights_dtype="float8_e4m3fn"``
on a Hopper GPU, read from the HLO that XLA compiles for its H200 description on this machine (a
deviceless compile: no GPU, not autotuned; abstract weights, nothing downloaded or allocated).

The weights are stored as a ``weights_dtype`` load stores them (``storage.layerwise``: diffusers'
layerwise-casting set, the UNet's ``norm`` pattern; fp8, no scale) and the call is the denoiser's
apply (``storage.upcast`` with the step's tie, then the UNet), bf16 compute, CFG's batch of 2.
Two ways, in one process:

    now      a plain fp8 1x1 conv is a matrix product on the fp8 weight (``layers.Conv2d``)
    before   ``upcast`` converts it, then XLA's convolution (``PREHEAT_FP8_1X1=conv``)

For each: the entry kernels, the cuDNN convolutions, the GEMMs that read an fp8 weight themselves,
the other kernels that read one and write a wider result (each a bf16 copy of a weight: the
widening) and the bytes they write, the GEMMs that write float32 (split-K partial sums, which a
reduction kernel then reads back) and their bytes, and the bytes all kernels write. The numbers behind docs/benchmarks.md,
"Plain fp8 1x1 convs as GEMMs on the fp8 weight (fp8three)".

    PYTHONPATH=src python benchmarks/fp8_unet_hlo.py [--model sd15|sdxl|both] [--layers]
    (``--layers``: one plain fp8 1x1 conv at each of SD 1.5's widths and resolutions instead)
    (needs the test extra's jax-cuda13-plugin)
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PREHEAT_CONV", "conv")  # XLA's convolutions, as a pod traces them (a deviceless auto trace writes GEMMs)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.fp8 import kernels, written_bytes  # noqa: E402
from preheat.bench.random_models import SD15_UNET  # noqa: E402
from preheat.bench.random_models import SDXL_UNET  # noqa: E402
from preheat.cache import targets  # noqa: E402
from preheat.cache.compile import on_device  # noqa: E402
from preheat.platforms import compiling_for  # noqa: E402
from preheat.models import storage  # noqa: E402
from preheat.models.quantised import FLOAT8  # noqa: E402
from preheat.models.unet2d_condition import UNet2DConditionConfig, build_abstract  # noqa: E402
from preheat.models.weights import LoadOptions, dtype_plan, torch_key  # noqa: E402

MODELS = {"sd15": ("SD 1.5 UNet", SD15_UNET, 64), "sdxl": ("SDXL UNet", SDXL_UNET, 128)}  # name, config, latent side


def unet_call(config: dict[str, Any], latent: int, batch: int = 2) -> tuple[Any, tuple[Any, ...]]:
    """(the apply, its abstract arguments): fp8 weights where a ``weights_dtype`` load puts them."""
    cfg = UNet2DConditionConfig.from_dict(config)
    graph, abstract = build_abstract(cfg)
    plan = dtype_plan(abstract, jnp.bfloat16, options=LoadOptions(weights_dtype=FLOAT8),
                      low=storage.layerwise(("norm",)))  # as unet2d_condition's loader asks
    flat = [(path, var.replace(jax.ShapeDtypeStruct(tuple(var.shape), plan(torch_key(path)))))
            for path, var in nnx.to_flat_state(abstract)]
    state = nnx.from_flat_state(flat)
    sds = jax.ShapeDtypeStruct
    x, t = sds((batch, latent, latent, 4), jnp.bfloat16), sds((batch,), jnp.float32)  # (B, H, W, 4), (B,)
    ctx = sds((batch, 77, cfg.cross_attention_dim), jnp.bfloat16)  # (B, 77, D)
    added = ({"text_embeds": sds((batch, 1280), jnp.bfloat16), "time_ids": sds((batch, 6), jnp.float32)}
             if cfg.addition_embed_type == "text_time" else None)

    def call(state: Any, x: Any, t: Any, ctx: Any, added: Any) -> Any:  # (B, H, W, 4) -> (B, H, W, 4)
        return nnx.merge(graph, storage.upcast(state, jnp.bfloat16, tie=x))(x, t, ctx, added)

    return call, (state, x, t, ctx, added)


def summary(hlo: str) -> dict[str, Any]:
    """The counts and bytes of one compiled program (see the module docstring)."""
    ks = kernels(hlo)
    copies = [k for k in ks if k.reads_fp8 and not k.gemm and not k.output.startswith("f8")]  # fp8 in, wider out
    partials = [k for k in ks if k.gemm and k.output.startswith("f32[")]  # split-K GEMMs' float32 partial sums
    return {"kernels": len(ks), "cudnn_convs": sum(k.op == "custom-call" and k.name.startswith("__cudnn$conv") for k in ks),
            "gemms_on_fp8": sum(k.gemm and bool(k.reads_fp8) for k in ks), "widening": len(copies),
            "widening_mb": sum(map(written_bytes, copies)) / 1e6, "f32_gemms": len(partials),
            "f32_gemm_mb": sum(map(written_bytes, partials)) / 1e6, "written_mb": sum(map(written_bytes, ks)) / 1e6}


def compile_h200(call: Any, args: tuple[Any, ...]) -> tuple[str, float]:
    device = targets.target_device(targets.resolve_target("h200"))
    jax.clear_caches()  # traced afresh: the other way's trace is not reused
    start = time.perf_counter()
    with compiling_for("gpu", (9, 0)):
        hlo = jax.jit(call).lower(*on_device(args, device)).compile().as_text()
    return hlo, time.perf_counter() - start


LAYERS = ((320, 64), (640, 32), (1280, 16), (1280, 8))  # SD 1.5's 1x1 convs: (channels, latent side), batch 2


def layer_call(c: int, side: int) -> tuple[Any, tuple[Any, ...]]:
    """One plain fp8 1x1 Conv2d with a bias, c -> c channels on (2, side, side, c), as the UNet applies it."""
    from preheat.models.layers import Conv2d
    from preheat.models.weights import build_abstract as build

    graph, abstract = build(lambda rngs: Conv2d(c, c, 1, rngs=rngs))
    abstract["kernel"].set_value(jax.ShapeDtypeStruct((1, 1, c, c), jnp.float8_e4m3fn))
    abstract["bias"].set_value(jax.ShapeDtypeStruct((c,), jnp.bfloat16))

    def call(state: Any, x: Any) -> Any:  # (2, side, side, c) -> (2, side, side, c)
        return nnx.merge(graph, storage.upcast(state, jnp.bfloat16, tie=x))(x)

    return call, (abstract, jax.ShapeDtypeStruct((2, side, side, c), jnp.bfloat16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("sd15", "sdxl", "both"), default="both")
    parser.add_argument("--hlo", help="also write each program's HLO text to HLO-<model>-<way>.txt")
    parser.add_argument("--layers", action="store_true", help="one 1x1 conv per SD 1.5 width instead of the UNets")
    args = parser.parse_args()
    if args.layers:
        programs = {f"c{c}-{side}": (f"1x1 conv {c} -> {c}", layer_call(c, side), side) for c, side in LAYERS}
    else:
        programs = {key: (name, unet_call(config, latent), latent) for key, (name, config, latent) in MODELS.items()
                    if args.model in (key, "both")}
    for key, (name, (call, call_args), latent) in programs.items():
        for way, setting in (("now", "gemm"), ("before", "conv")):
            old = os.environ.get("PREHEAT_FP8_1X1")
            os.environ["PREHEAT_FP8_1X1"] = setting  # before: every plain fp8 kernel converted by upcast
            try:
                hlo, seconds = compile_h200(call, call_args)  # traced afresh, under this setting
            finally:
                if old is None:
                    os.environ.pop("PREHEAT_FP8_1X1")
                else:
                    os.environ["PREHEAT_FP8_1X1"] = old
            row = summary(hlo)
            if args.hlo:
                with open(f"{args.hlo}-{key}-{way}.txt", "w") as f:
                    f.write(hlo)
            print(f"{name}, batch 2, {latent}x{latent} latents, {way}: "
                  + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
                  + f" (compiled in {seconds:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
