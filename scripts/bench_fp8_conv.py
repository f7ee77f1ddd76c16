"""The kernels one scaled fp8 Conv2d compiles to on a Hopper GPU, read from the HLO that XLA compiles
for its H200 description on this machine (a deviceless compile: no GPU, not autotuned), and a 1x1
one's time on this CPU.

One SD-width conv (640 -> 640 channels with a bias, 2 x 64 x 64 pixels, bf16 compute) as a
denoiser's apply runs it (``storage.upcast`` with the step's tie, then ``layers.Conv2d``), its
weight scaled fp8 with one scale per output channel, 1x1 and 3x3, each against its other way: a
1x1 conv's scale on the weight (XLA's convolution of ``values * scale``: the path before), a 3x3
conv's scale on the output (``conv(x, values) * scale``). Prints each kernel (an entry fusion or a
cuDNN call) and the bytes it writes. The numbers behind docs/benchmarks.md, "Scaled fp8 convs: the
scale where it costs no kernel (fp8conv)".

    PYTHONPATH=src python scripts/bench_fp8_conv.py [--cpu] [--rounds 20]
    (needs the test extra's jax-cuda13-plugin; ``--cpu`` also times the 1x1 conv here, both ways)
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PREHEAT_CONV", "conv")  # XLA's convolutions, as a pod traces them (a deviceless auto trace writes GEMMs)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from preheat.bench.common import round_robin_ms  # noqa: E402
from preheat.bench.fp8 import kernels, written_bytes  # noqa: E402
from preheat.cache import targets  # noqa: E402
from preheat.cache.compile import on_device  # noqa: E402
from preheat.platforms import compiling_for  # noqa: E402
from preheat.models.conv import conv2d  # noqa: E402
from preheat.models.layers import Conv2d, lift  # noqa: E402
from preheat.models.quantised import Quantised  # noqa: E402
from preheat.models.storage import upcast  # noqa: E402
from preheat.models.weights import build_abstract  # noqa: E402

WIDTH, PIXELS = 640, (2, 64, 64)


def layer_fns(k: int) -> tuple[Any, Any, Any]:
    """(graphdef, the layer as preheat applies it, the other way) for a kxk scaled fp8 conv."""
    graphdef, _ = build_abstract(lambda rngs: Conv2d(WIDTH, WIDTH, k, padding=k // 2, rngs=rngs))

    def layer(params, x):  # (B, H, W, C) -> (B, H, W, C)
        return nnx.merge(graphdef, upcast(params, x.dtype, tie=x))(x)

    def other(params, x):  # 1x1: the scale on the weight; 3x3: the scale on the output
        q = params["kernel"].get_value()
        (values,), _ = jax.lax.optimization_barrier(((q.values,), x))
        bias = lift(params["bias"].get_value().astype(x.dtype), 4)
        if k == 1:
            return conv2d(x, Quantised(values, q.scale).expand(x.dtype), 1, 0, impl="conv") + bias
        y = conv2d(x, values.astype(x.dtype), 1, 1, impl="conv").astype(jnp.float32) * q.scale.reshape(1, 1, 1, -1)
        return y.astype(x.dtype) + bias

    return graphdef, layer, other


def program_kernels(k: int, fn_index: int) -> list[tuple[str, str, int]]:
    """(kernel, output type, bytes written) for each kernel of the H200 program (``preheat.bench.fp8``)."""
    _, abstract = build_abstract(lambda rngs: Conv2d(WIDTH, WIDTH, k, padding=k // 2, rngs=rngs))
    fp8 = jax.ShapeDtypeStruct((k, k, WIDTH, WIDTH), jnp.float8_e4m3fn)
    abstract["kernel"].set_value(Quantised(fp8, jax.ShapeDtypeStruct((1, 1, 1, WIDTH), jnp.float32)))
    abstract["bias"].set_value(jax.ShapeDtypeStruct((WIDTH,), jnp.bfloat16))
    x = jax.ShapeDtypeStruct((*PIXELS, WIDTH), jnp.bfloat16)
    fn = layer_fns(k)[1 + fn_index]
    device = targets.target_device(targets.resolve_target("h200"))
    with compiling_for("gpu", (9, 0)):
        hlo = jax.jit(fn).lower(*on_device((abstract, x), device)).compile().as_text()
    return [(kernel.name.removeprefix("__cudnn$").removesuffix("_computation"), kernel.output.split("{")[0].lstrip("("),
             written_bytes(kernel)) for kernel in kernels(hlo)]


def cpu_times(rounds: int, dtype: Any) -> dict[str, float]:
    """Median ms per call of the scaled 1x1 conv on this CPU (32 x 32 pixels, batch 2), the scale on
    the GEMM's output (as ``layers.Conv2d`` applies it now) against the scale on the weight and
    XLA's convolution (as before), timed round-robin in one process."""
    rng = np.random.default_rng(0)
    graphdef, layer, other = layer_fns(1)
    _, state = nnx.split(Conv2d(WIDTH, WIDTH, 1, rngs=nnx.Rngs(0)))
    values = jnp.asarray(rng.standard_normal((1, 1, WIDTH, WIDTH)), jnp.float8_e4m3fn)
    state["kernel"].set_value(Quantised(values, jnp.asarray(rng.random((1, 1, 1, WIDTH)) * 0.01, jnp.float32)))
    x = jnp.asarray(rng.standard_normal((2, 32, 32, WIDTH)), dtype)
    calls = {"scale on the GEMM's output": jax.jit(layer), "scale on the weight, XLA's conv": jax.jit(other)}
    return round_robin_ms({name: functools.partial(fn, state, x) for name, fn in calls.items()}, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="also time the 1x1 conv on this CPU, both ways")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    names = {1: ("1x1, scale on the GEMM's output (now)", "1x1, scale on the weight (before)"),
             3: ("3x3, scale on the weight (now, as before)", "3x3, scale on the output (not taken)")}
    for k, (now, other) in names.items():
        for i, name in enumerate((now, other)):
            rows = program_kernels(k, i)
            total = sum(b for _, _, b in rows) / 1e6
            detail = "; ".join(f"{n} {t} {b / 1e6:.2f} MB" for n, t, b in rows)
            print(f"{name}: {len(rows)} kernel(s), {total:.2f} MB written -- {detail}")
    if args.cpu:
        for dtype in (jnp.float32, jnp.bfloat16):
            ms = cpu_times(args.rounds, dtype)
            print(f"CPU 1x1 conv, 2x32x32x{WIDTH}, {jnp.dtype(dtype).name}: "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()))


if __name__ == "__main__":
    main()
