"""SDXL's UNet on a TPU chip (issue 56 item 3, issue 57 item 3): one denoiser call at 1024² (128² latents),
batch 2 (CFG at batch 1) and 8 (CFG at batch 4), random bf16 weights (views of one pool), per form:

    scanned, unrolled         the transformer stages as one lax.scan / one copy per block (compile and speed)
    fences-off, fences-on     scanned, with PREHEAT_FENCES forced (models.conv.fence)

Prints compile seconds, median/min/max ms of 12 calls, XLA's FLOPs (a scan's body counts once: take
TFLOP/s from the unrolled row) and peak HBM; writes $OUT/sdxl_prof.json, the optimised HLO of the
batch-2 call of TRACE_FORM and a profiler trace of it (xplane.pb.gz: read with xprof's hlo_stats).

    FORMS=scanned,unrolled BATCHES=2,8 python3 benchmarks/tpu_unet_profile.py      # ~5 min on a v5e
    FORMS=fences-off,fences-on TRACE_FORM=fences-on python3 benchmarks/tpu_unet_profile.py
    DRY=1 JAX_PLATFORMS=cpu ...                                                      # a small UNet, the script's check

Results: docs/tpu.md.
"""
import gzip, json, os, shutil, statistics, sys, time
from pathlib import Path

sys.path.insert(0, "src"); sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
OUT = Path(os.environ.get("OUT", "/tmp/out"))
OUT.mkdir(parents=True, exist_ok=True)
import jax
import jax.numpy as jnp
import numpy as np
from benchmarks.compile_cut import _unet, _random_params, TINY_DEEP_UNET
from preheat.bench.random_models import SDXL_UNET
from preheat.models.unet2d_condition import LoadedUNet2DCondition

res = {}
FORMS = os.environ.get("FORMS", "scanned,unrolled").split(",")
DRY = os.environ.get("DRY") == "1"
CONFIG = TINY_DEEP_UNET if DRY else SDXL_UNET
LAT, POOL = (32, TINY_DEEP_UNET.get("projection_class_embeddings_input_dim", 0) - 6 * TINY_DEEP_UNET.get("addition_time_embed_dim", 0)) if DRY else (128, 1280)
BATCHES = [int(b) for b in os.environ.get("BATCHES", "2,8").split(",")]


def dump():
    (OUT / "sdxl_prof.json").write_text(json.dumps(res, indent=1, default=str))


def inputs(batch):
    rng = np.random.RandomState(1)
    x = jnp.asarray(rng.randn(batch, LAT, LAT, 4).astype(np.float32)).astype(jnp.bfloat16)
    t = jnp.full((batch,), 500.0, jnp.float32)
    ctx = jnp.asarray(rng.randn(batch, 77, CONFIG['cross_attention_dim']).astype(np.float32)).astype(jnp.bfloat16)
    added = {"text_embeds": jnp.asarray(rng.randn(batch, POOL), jnp.bfloat16),
             "time_ids": jnp.asarray([[1024, 1024, 0, 0, 1024, 1024]] * batch, jnp.float32)}
    return x, t, ctx, added


def pool_params(abstract_state):
    import ml_dtypes
    from flax import nnx
    pool = (np.random.default_rng(0).standard_normal(1 << 22) * 0.02).astype(ml_dtypes.bfloat16)
    out = []
    for path, var in nnx.to_flat_state(abstract_state):
        sh = var.get_value().shape
        vals = np.resize(pool, sh)
        if str(path[-1]) == "scale":
            vals = (vals.astype(np.float32) + 1).astype(ml_dtypes.bfloat16)
        out.append((path, var.replace(jax.device_put(vals))))
    return nnx.from_flat_state(out)


for form in FORMS:
    if form.startswith("fences-"):
        os.environ["PREHEAT_FENCES"] = form.split("-", 1)[1]
    stacked = form.startswith("scanned") or form.startswith("fences")
    abstract, args = _unet(CONFIG, stacked, 2, LAT, POOL, jnp.bfloat16)
    t0 = time.perf_counter()
    params = pool_params(args[0])
    jax.block_until_ready(params)
    unet = LoadedUNet2DCondition(config=abstract.config, graphdef=abstract.graphdef, params=params, dtype=jnp.bfloat16)
    r = res.setdefault(form, {"init_s": round(time.perf_counter() - t0, 2)})
    for batch in BATCHES:
        x, t, ctx, added = inputs(batch)
        f = jax.jit(unet.apply)
        t0 = time.perf_counter()
        lowered = f.lower(params, x, t, ctx, added)
        tl = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        tc = time.perf_counter() - t0
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        ts = []
        jax.block_until_ready(compiled(params, x, t, ctx, added))
        for _ in range(12):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, x, t, ctx, added))
            ts.append(time.perf_counter() - t0)
        med = statistics.median(ts)
        flops = ca.get("flops")
        mem = jax.devices()[0].memory_stats() or {}
        r[f"b{batch}"] = {"lower_s": round(tl, 2), "compile_s": round(tc, 2), "median_ms": round(med * 1e3, 3),
                          "min_ms": round(min(ts) * 1e3, 3), "max_ms": round(max(ts) * 1e3, 3),
                          "flops": flops, "bytes": ca.get("bytes accessed"),
                          "tflops": round(flops / med * 1e-12, 1) if flops else None,
                          "peak_bytes": mem.get("peak_bytes_in_use")}
        print(form, batch, r[f"b{batch}"], flush=True)
        dump()
        if form == os.environ.get("TRACE_FORM", "scanned") and batch == 2:
            with gzip.open(OUT / "sdxl_b2_hlo.txt.gz", "wt") as fh:
                fh.write(compiled.as_text())
            tr = Path("/tmp/trace")
            jax.profiler.start_trace(str(tr))
            for _ in range(2):
                jax.block_until_ready(compiled(params, x, t, ctx, added))
            jax.profiler.stop_trace()
            found = list(tr.rglob("*.xplane.pb"))
            if found:
                with open(found[0], "rb") as src, gzip.open(OUT / "sdxl_b2.xplane.pb.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                r["xplane_bytes"] = found[0].stat().st_size
        del compiled, lowered
    del params, unet
    dump()
print(json.dumps(res), flush=True)
