"""int8 against fp8 and bf16 weights in FLUX.1's Linear layers, timed on the accelerator (issue 59 item 1:
"measure both and choose"), as one JSON object.

FLUX.1's transformer at 1024² is Linear layers over 4096 image tokens (its 19 double blocks; 4608
with the text in its 38 single blocks) of width 3072: q/k/v/out 3072 -> 3072, the MLP 3072 -> 12288
-> 3072, a single block's fused 3072 -> 21504 and 15360 -> 3072. ``--layers`` distinct weights of
each shape (so the weights stream from HBM as in the model, not from a cache) run in one program,
each product as the denoiser's apply runs it: ``storage.upcast`` with the step's tie, then
``Quantised.product`` for int8 (per-channel scales, made by ``quantised.quantise_int8`` on the
device) and per-channel scaled fp8, a plain convert for fp8 and nothing for bf16. Reports, per
weight dtype: ms per call (median of ``--rounds``, round-robin), TFLOP/s, the weights' bytes, and
the relative error of the output against the float32 product on the host for the first layer of
each shape (``|y - y32| / |y32|``, Frobenius). Also, per shape: whether the compiled program keeps
a bf16 copy of the weight (temp bytes of XLA's memory analysis).

    python3 scripts/bench_int8_tpu.py [--layers 8] [--rounds 10] [--tokens 4096] > $OUT/int8.json

On a CPU it runs too (``--tokens 64 --layers 2``: the check of the script itself); its times mean
nothing there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

SHAPES = [(3072, 3072), (3072, 12288), (12288, 3072), (3072, 21504), (15360, 3072)]  # (in, out)
KINDS = ("bf16", "int8", "fp8", "fp8-scaled")


def _weights(kind: str, shape: tuple[int, int], layers: int, key: Any) -> tuple[list[Any], Any]:
    """``layers`` random weights of ``shape`` stored as ``kind``, and the float32 first one (host reference)."""
    import jax
    import jax.numpy as jnp

    from preheat.models.quantised import Quantised, quantise_int8

    out, first = [], None
    for i in range(layers):
        w = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * (shape[0] ** -0.5)  # (in, out)
        if kind == "bf16":
            stored = w.astype(jnp.bfloat16)
        elif kind == "int8":
            stored = Quantised(*quantise_int8(w))
        elif kind == "fp8":
            stored = w.astype(jnp.float8_e4m3fn)
        else:  # per-channel scaled fp8: max|w| / 448 per output
            scale = jnp.max(jnp.abs(w), axis=0, keepdims=True) / 448.0  # (1, out)
            stored = Quantised((w / scale).astype(jnp.float8_e4m3fn), scale)
        out.append(stored)
        if i == 0:
            first = w
    jax.block_until_ready(out)
    return out, first


def _program(n: int) -> Any:
    import jax
    import jax.numpy as jnp

    from preheat.models.quantised import Quantised
    from preheat.models.storage import upcast

    def run(params: list[Any], x: Any) -> Any:  # x (tokens, in) -> the sum of every layer's (tokens, out)
        params = upcast({"layers": {str(i): {"kernel": p} for i, p in enumerate(params)}}, jnp.bfloat16, tie=x)
        total = None
        for i in range(n):
            k = params["layers"][str(i)]["kernel"]
            y = k.product(x) if isinstance(k, Quantised) else x @ k.astype(jnp.bfloat16)  # (tokens, out)
            total = y if total is None else total + y
        return total

    return jax.jit(run)


def main() -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    device = jax.devices()[0]
    result: dict[str, Any] = {"device": device.device_kind, "platform": device.platform, "tokens": args.tokens,
                              "layers": args.layers, "rows": []}
    key = jax.random.key(0)
    for shape in SHAPES:
        x32 = jax.random.normal(jax.random.fold_in(key, 99), (args.tokens, shape[0]), jnp.float32)
        x = x32.astype(jnp.bfloat16)
        run = _program(args.layers)
        programs, weights, errors, temps = {}, {}, {}, {}
        for kind in KINDS:
            params, first = _weights(kind, shape, args.layers, key)
            compiled = run.lower(params, x).compile()
            programs[kind], weights[kind] = compiled, params
            temps[kind] = int(compiled.memory_analysis().temp_size_in_bytes)
            one = _program(1)(params[:1], x).astype(jnp.float32)  # (tokens, out)
            ref = np.asarray(x.astype(jnp.float32)) @ np.asarray(first)  # the host's float32 product
            errors[kind] = float(np.linalg.norm(np.asarray(one) - ref) / np.linalg.norm(ref))
            jax.block_until_ready(compiled(params, x))  # warm
        times: dict[str, list[float]] = {k: [] for k in KINDS}
        for _ in range(args.rounds):  # round-robin: drift hits every kind alike
            for kind in KINDS:
                t0 = time.perf_counter()
                jax.block_until_ready(programs[kind](weights[kind], x))
                times[kind].append((time.perf_counter() - t0) * 1e3)
        flop = 2 * args.tokens * shape[0] * shape[1] * args.layers
        for kind in KINDS:
            ms = statistics.median(times[kind])
            nbytes = sum(int(leaf.nbytes) for leaf in jax.tree.leaves(weights[kind]))
            result["rows"].append({"shape": list(shape), "kind": kind, "ms": round(ms, 3),
                                   "tflops": round(flop / ms / 1e9, 1), "weight_bytes": nbytes,
                                   "temp_bytes": temps[kind], "rel_err_vs_f32": errors[kind]})
        print(f"{shape}: " + ", ".join(f"{r['kind']} {r['ms']} ms" for r in result["rows"][-len(KINDS):]),
              file=sys.stderr)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
