"""The kernels one fp8 Linear layer compiles to on a Hopper GPU, read from the HLO that XLA compiles
for its H200 description on this machine (a deviceless compile: no GPU, not autotuned).

One FLUX.1-width layer (3072 -> 3072 with a bias, 4096 tokens, bf16 compute) as a denoiser's apply
runs it (``storage.upcast`` with the step's tie, then ``layers.Linear``), its weight stored plain
fp8, or scaled fp8 with one scale per tensor or per output channel. Prints each kernel (an entry
fusion) and the bytes it writes (its output). Run it with this tree's ``src`` and with an older
one's to compare. The numbers behind docs/benchmarks.md, "Scaled fp8: the scale on the GEMM's output".

    PYTHONPATH=src python scripts/bench_fp8_gemm.py [--cpu] [--tokens 256] [--rounds 30]
    (needs the test extra's jax-cuda13-plugin; ``--cpu`` also times the layer here, both ways)
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from preheat.bench.common import round_robin_ms  # noqa: E402
from preheat.cache import targets  # noqa: E402
from preheat.cache.compile import on_device  # noqa: E402
from preheat.platforms import compiling_for  # noqa: E402
from preheat.models.layers import Linear  # noqa: E402
from preheat.models.quantised import Quantised  # noqa: E402
from preheat.models.storage import upcast  # noqa: E402
from preheat.models.weights import build_abstract  # noqa: E402

BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f8e4m3fn": 1}
WIDTH, TOKENS = 3072, 4096


def kernels(scale: tuple[int, ...] | None) -> list[tuple[str, str, int]]:
    """(kernel, output type, bytes written) for each entry fusion of the layer's H200 program."""
    graphdef, abstract = build_abstract(lambda rngs: Linear(WIDTH, WIDTH, rngs=rngs))
    fp8 = jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float8_e4m3fn)
    abstract["kernel"].set_value(fp8 if scale is None else Quantised(fp8, jax.ShapeDtypeStruct(scale, jnp.float32)))
    abstract["bias"].set_value(jax.ShapeDtypeStruct((WIDTH,), jnp.bfloat16))
    x = jax.ShapeDtypeStruct((TOKENS, WIDTH), jnp.bfloat16)

    def layer(params, x):  # (tokens, in) -> (tokens, out)
        return nnx.merge(graphdef, upcast(params, jnp.bfloat16, tie=x))(x)

    device = targets.target_device(targets.resolve_target("h200"))
    with compiling_for("gpu", (9, 0)):
        hlo = jax.jit(layer).lower(*on_device((abstract, x), device)).compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    out = []
    for dtype, shape, calls in re.findall(r"= (\w+)\[([\d,]*)\]\S* fusion\(.*?calls=%([\w.\-]+)", entry):
        dims = [int(d) for d in shape.split(",") if d]
        out.append((calls.removesuffix("_computation"), f"{dtype}[{shape}]", BYTES[dtype] * int(np.prod(dims))))
    return out


def cpu_times(tokens: int, rounds: int, dtype: Any) -> dict[str, float]:
    """Median ms per call of the same scaled fp8 layer (per-tensor scale) on this CPU, the scale on
    the product (as ``layers.Linear`` applies it now) against the scale on the weight (``values *
    scale`` first, as before), timed round-robin in one process."""
    rng = np.random.default_rng(0)
    graphdef, state = nnx.split(Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0)))
    values = jnp.asarray(rng.standard_normal((WIDTH, WIDTH)), jnp.float8_e4m3fn)
    state["kernel"].set_value(Quantised(values, jnp.float32(0.01)))
    x = jnp.asarray(rng.standard_normal((tokens, WIDTH)), dtype)

    def product(params, x):
        return nnx.merge(graphdef, upcast(params, dtype, tie=x))(x)

    def on_weight(params, x):
        params = upcast(params, dtype, tie=x)
        params["kernel"].set_value(params["kernel"].get_value().expand(dtype))
        return nnx.merge(graphdef, params)(x)

    calls = {"scale on the product": jax.jit(product), "scale on the weight": jax.jit(on_weight)}
    return round_robin_ms({name: functools.partial(fn, state, x) for name, fn in calls.items()}, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="also time the layer on this CPU, both ways")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    for name, scale in (("plain fp8", None), ("scaled fp8, per tensor", ()), ("scaled fp8, per channel", (1, WIDTH))):
        rows = kernels(scale)
        total = sum(b for _, _, b in rows) / 1e6
        detail = "; ".join(f"{k} {t} {b / 1e6:.1f} MB" for k, t, b in rows)
        print(f"{name}: {len(rows)} kernel(s), {total:.1f} MB written -- {detail}")
    if args.cpu:
        for dtype in (jnp.float32, jnp.bfloat16):
            ms = cpu_times(args.tokens, args.rounds, dtype)
            print(f"CPU, {args.tokens} tokens, {jnp.dtype(dtype).name}: "
                  + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))


if __name__ == "__main__":
    main()
