"""Which convolution form compiles and runs fastest on the TPU, per UNet and batch: each
(model, batch, form) compiled and timed in a fresh process (libtpu's compiler has crashed the
process on XLA's convolution: SD 1.5 at batch 8, issue 56), one JSON document on stdout.

Run on the TPU machine from the repository root (each child ~1-3 min; pick a few with --only):

    PYTHONPATH=src python scripts/tpu_conv.py --models sd15 --batches 2,4,8 --forms auto,conv,im2col

A row: the model, the images per call (the UNet sees twice as many latents: classifier-free
guidance), ``PREHEAT_CONV`` (``auto``: ``preheat.platforms``' TPU choice per layer), the child's
exit code (-11: the compiler's SIGSEGV), compile seconds and the median ms of one UNet call on
zero weights. Feeds ``IM2COL_MIN_BATCH`` in ``preheat/platforms/_tpu.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LATENT = {"sd15": 64, "sdxl": 128}


def child(model: str, batch: int) -> dict:
    """One UNet call (CFG's doubled batch) compiled and timed on the local device, zero bf16 weights."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from preheat.bench.random_models import SD15_UNET, SDXL_UNET
    from preheat.models.unet2d_condition import UNet2DConditionConfig, build_abstract

    cfg = UNet2DConditionConfig.from_dict(SD15_UNET if model == "sd15" else SDXL_UNET)
    graph, state = build_abstract(cfg)
    state = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.bfloat16), state)
    n, lat = 2 * batch, LATENT[model]
    x, t = jnp.zeros((n, lat, lat, 4), jnp.bfloat16), jnp.ones((n,), jnp.float32)
    ctx = jnp.zeros((n, 77, cfg.cross_attention_dim), jnp.bfloat16)
    added = ({"text_embeds": jnp.zeros((n, 1280), jnp.bfloat16), "time_ids": jnp.zeros((n, 6), jnp.float32)}
             if cfg.addition_embed_type == "text_time" else None)

    def call(state, x, t, ctx, added):  # (2B, H, W, 4) -> (2B, H, W, 4)
        return nnx.merge(graph, state)(x, t, ctx, added)

    start = time.perf_counter()
    compiled = jax.jit(call).lower(state, x, t, ctx, added).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(state, x, t, ctx, added))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, x, t, ctx, added))
        times.append(time.perf_counter() - start)
    return {"compile_s": round(compile_s, 1), "call_ms": round(statistics.median(times) * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sd15")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--forms", default="auto,conv,im2col")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per child")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    rows = []
    for model in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            for form in args.forms.split(","):
                env = {**os.environ, "PREHEAT_CONV": form}
                row: dict = {"model": model, "batch": batch, "latents": 2 * batch, "conv": form}
                try:
                    proc = subprocess.run([sys.executable, __file__, "--child", model, str(batch)], env=env,
                                          capture_output=True, text=True, timeout=args.timeout)
                    row["rc"] = proc.returncode
                    if proc.returncode == 0:
                        row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                    else:
                        row["error"] = (proc.stderr.strip().splitlines() or [""])[-1][:200]
                except subprocess.TimeoutExpired:
                    row["rc"], row["error"] = None, f"timed out after {args.timeout} s"
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    json.dump({"rows": rows}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
