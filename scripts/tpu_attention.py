"""Attention on the TPU: XLA's vs jax's Pallas flash kernel through preheat's wrapper (padding and
masking included), per layer shape and block size; prints one JSON document.

Run on the TPU machine from the repository root (one chip, a few minutes):

    PYTHONPATH=src python scripts/tpu_attention.py > attention.json
    PYTHONPATH=src python scripts/tpu_attention.py --quick   # the auto choice and XLA's only

Each row: the layer (B, heads, query tokens L, key tokens M, head dim D), XLA's milliseconds
(``jax.nn.dot_product_attention``), what ``preheat.platforms`` picks for it on the TPU (``auto``)
and its milliseconds, then the flash kernel at each block size and head-dim padding tried, with the
largest absolute difference from XLA's output. Medians of ``--calls`` calls after one warm-up.
Feeds ``preheat/platforms/_tpu.py``'s table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from preheat import platforms
from preheat.models.attention import flash_attention

# (name, B, heads, L, M, D): the layers of SD 1.5, SDXL and Flux at their native sizes, CFG's batch
SHAPES = [
    ("sdxl_self_4096", 2, 10, 4096, 4096, 64), ("sdxl_cross_4096x77", 2, 10, 4096, 77, 64),
    ("sdxl_self_1024", 2, 20, 1024, 1024, 64), ("sdxl_cross_1024x77", 2, 20, 1024, 77, 64),
    ("sdxl_b4_self_4096", 8, 10, 4096, 4096, 64),
    ("sd15_self_4096_d40", 2, 8, 4096, 4096, 40), ("sd15_cross_4096x77_d40", 2, 8, 4096, 77, 40),
    ("sd15_self_1024_d80", 2, 8, 1024, 1024, 80), ("sd15_self_256_d160", 2, 8, 256, 256, 160),
    ("sd15_b8_self_4096_d40", 16, 8, 4096, 4096, 40),
    ("flux_joint_4608", 1, 24, 4608, 4608, 128), ("sd3_joint_4250", 2, 24, 4250, 4250, 64),
    ("cross_4096x154", 2, 10, 4096, 154, 64), ("cross_4096x512", 1, 24, 4096, 512, 128),
]
BLOCKS = [(1024, 1024), (512, 512), (1024, 512), (256, 256), (1536, 512)]


def timed(fn, *args, calls: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def row(name: str, b: int, h: int, l: int, m: int, d: int, calls: int, quick: bool) -> dict:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, l, h, d)), jnp.bfloat16)  # (B, L, nH, Dh)
    k, v = (jnp.asarray(rng.standard_normal((b, m, h, d)), jnp.bfloat16) for _ in range(2))  # (B, M, nH, Dh)
    xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"))
    ref = np.asarray(xla(q, k, v), np.float32)
    out: dict = {"shape": name, "B": b, "H": h, "L": l, "M": m, "D": d, "xla_ms": timed(xla, q, k, v, calls=calls)}
    layer = platforms.AttentionLayer("bfloat16", d, l, m, h)
    auto = platforms.get("tpu").attention(layer)
    out["auto"] = auto._asdict()
    flash = platforms.flash_choice(layer)
    tries = [("auto", auto)] if auto.impl == "flash" else []
    if not quick:
        pads = sorted({flash.head_dim, d if d <= 128 else flash.head_dim})  # as chosen, and unpadded
        tries += [(f"flash_{bq}x{bk}_d{dp}", flash._replace(block_q=bq, block_k=bk, head_dim=dp))
                  for bq, bk in BLOCKS for dp in pads if bq <= -(-l // 128) * 128 and bk <= -(-m // 128) * 128]
    for label, choice in tries:
        fn = jax.jit(lambda q, k, v, c=choice: flash_attention(q, k, v, c))
        try:
            got = np.asarray(fn(q, k, v), np.float32)
            out[f"{label}_ms"] = timed(fn, q, k, v, calls=calls)
            out[f"{label}_maxerr"] = round(float(np.abs(got - ref).max()), 4)
        except Exception as exc:  # a block the chip's memory refuses: say so, go on
            out[f"{label}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="XLA's and the auto choice only")
    parser.add_argument("--only", default="", help="comma-separated shape names")
    args = parser.parse_args()
    wanted = set(filter(None, args.only.split(",")))
    dev = jax.devices()[0]
    rows = []
    for shape in SHAPES:
        if wanted and shape[0] not in wanted:
            continue
        rows.append(row(*shape, calls=args.calls, quick=args.quick))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress, in case the call is cut short
    json.dump({"device": platforms.describe_device(dev), "jax": jax.__version__, "rows": rows}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
