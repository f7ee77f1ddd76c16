"""SDXL's feed-forward (GEGLU: 1280 -> 2 x 5120, ``h * gelu(gate)``, -> 1280) at its 32² stage on a TPU
chip (issue 56 item 3): where the exact GELU's vector work goes, as ``LAYERS`` distinct weights run in turn
(batch 2 = CFG, 1024 tokens, bf16). Forms:

    fused       the product straight into the down projection (XLA fuses it into that GEMM's operand)
    fenced      the product fenced (``models.conv.fence``: what the TPU platform traces)
    split       h and gate as two GEMMs on the halves of the weight, the fenced product of their outputs
                (so the GELU can be the gate GEMM's epilogue)
    tanh        the tanh GELU, fenced (not diffusers' numerics: the floor of the vector work)

Median ms per feed-forward, TFLOP/s of its two GEMMs, max |diff| against ``fused`` over max |fused|. $OUT/geglu.json.

    python3 benchmarks/tpu_geglu.py                    # ~1 min on a v5e
    DRY=1 JAX_PLATFORMS=cpu python3 benchmarks/tpu_geglu.py
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

DRY = os.environ.get("DRY") == "1"
B, T, C = (2, 64, 64) if DRY else (2, 1024, 1280)
INNER = 4 * C
LAYERS = 2 if DRY else 10
OUT = Path(os.environ.get("OUT", "/tmp/out"))


def ff(form: str, x, w_in, w_out):  # (B, T, C) -> (B, T, C)
    if form == "split":
        h = x @ w_in[:, :INNER]
        gate = x @ w_in[:, INNER:]
        y = jax.lax.optimization_barrier(h * jax.nn.gelu(gate, approximate=False))
    else:
        h, gate = jnp.split(x @ w_in, 2, axis=-1)
        y = h * jax.nn.gelu(gate, approximate=form == "tanh")
        if form in ("fenced", "tanh"):
            y = jax.lax.optimization_barrier(y)
    return x + y @ w_out


def main() -> None:
    rng = np.random.default_rng(0)
    ws = [(jnp.asarray(rng.standard_normal((C, 2 * INNER)) * 0.02, jnp.bfloat16),
           jnp.asarray(rng.standard_normal((INNER, C)) * 0.02, jnp.bfloat16)) for _ in range(LAYERS)]
    x = jnp.asarray(rng.standard_normal((B, T, C)), jnp.bfloat16)
    flops = LAYERS * 2 * B * T * (C * 2 * INNER + INNER * C)
    res: dict = {"device": jax.devices()[0].device_kind, "shape": [B, T, C], "layers": LAYERS}
    ref = None
    for form in ("fused", "fenced", "split", "tanh"):
        def run(x, ws, form=form):
            for w_in, w_out in ws:
                x = ff(form, x, w_in, w_out)
            return x
        fn = jax.jit(run)
        out = np.asarray(fn(x, ws), np.float32)
        ts = []
        for _ in range(10):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x, ws))
            ts.append(time.perf_counter() - t0)
        med = statistics.median(ts)
        ref = out if ref is None else ref
        res[form] = {"ms_per_ff": round(med / LAYERS * 1e3, 4), "tflops": round(flops / med * 1e-12, 1),
                     # relative: ten random residual layers grow the output (to ~1e10 at full size)
                     "max_rel_diff_vs_fused": float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))}
        print(form, res[form], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "geglu.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
