"""FLUX.1-dev's transformer on a TPU chip (issue 59): the published config (19 + 38 blocks, width 3072) at
1024² (4096 image + 512 text tokens), batch 1, loaded through preheat's own path (``build_flux_transformer``:
fill, int8 quantisation on the device, the blocks stacked for their scan) from random bf16 tensors (strided
views of one small pool: no host copy of the model; timing only). One call is one step (FLUX.1's guidance
is embedded: no CFG batch). Per weight dtype (WEIGHTS=int8[,bf16]; int8 with ``weights_layers="linear"``,
the plan that fits a v5e) and PREHEAT_FENCES setting (FENCES=on,off): compile seconds, median/min/max ms
of 6 calls, TFLOP/s of the formula below, peak HBM. $OUT/flux_steady.json.

    WEIGHTS=int8 FENCES=on,off python3 benchmarks/tpu_flux_steady.py     # ~1.5 min on a v5e
    DRY=1 JAX_PLATFORMS=cpu python3 benchmarks/tpu_flux_steady.py        # a 2 + 3 block model, the script's check

Results: docs/tpu.md.
"""
import json, os, statistics, sys, time
from pathlib import Path

sys.path.insert(0, "src"); sys.path.insert(0, ".")
OUT = Path(os.environ.get("OUT", "/tmp/out")); OUT.mkdir(parents=True, exist_ok=True)
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from benchmarks.compile_cut import FLUX_DEV
from preheat.models.flux import FluxTransformerConfig, build_flux_transformer, build_abstract
from preheat.models.weights import LoadOptions, torch_key, expected_torch_shape
from flax import nnx

DRY = os.environ.get("DRY") == "1"
cfg_dict = dict(FLUX_DEV)
if DRY:
    cfg_dict.update(num_layers=2, num_single_layers=3, num_attention_heads=2, attention_head_dim=32,
                    joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(8, 12, 12))
cfg = FluxTransformerConfig.from_dict(cfg_dict)
TOK, TXT = (256, 32) if DRY else (4096, 512)
res = {"tokens": TOK, "text": TXT}
POOL = (np.random.default_rng(0).standard_normal(1 << 16) * 0.02).astype(ml_dtypes.bfloat16)


class Views(dict):
    """torch key -> a bf16 view of POOL with the checkpoint's shape (rows repeat: timing only)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes = shapes

    def get(self, k, default=None):
        return self[k] if k in self.shapes else default

    def __getitem__(self, k):
        shape = self.shapes[k]
        last = shape[-1] if shape else 1
        base = POOL[:last] if last <= POOL.size else np.resize(POOL, last)
        v = np.lib.stride_tricks.as_strided(base, shape=shape, strides=(0,) * (len(shape) - 1) + (2,) if shape else ())
        if k.endswith("norm.weight") or k.endswith(".scale"):
            v = (np.asarray(v, np.float32) * 0 + 1).astype(ml_dtypes.bfloat16)
        return v

    def __contains__(self, k):
        return k in self.shapes

    def keys(self):
        return self.shapes.keys()

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self):
        return len(self.shapes)


_, abstract = build_abstract(cfg)
shapes = {}
for path, var in nnx.to_flat_state(abstract):
    leaf = str(path[-1])
    shapes[torch_key(path)] = expected_torch_shape(tuple(var.get_value().shape), leaf)


def dump():
    (OUT / "flux_steady.json").write_text(json.dumps(res, indent=1, default=str))


def flops_per_step():
    d, h = cfg.num_attention_heads * cfg.attention_head_dim, cfg.num_attention_heads
    L = TOK + TXT
    double = TOK * (4 * d * d + 2 * d * 4 * d) * 2 + TXT * (4 * d * d + 2 * d * 4 * d) * 2 + 4 * L * L * d
    single = L * (d * (3 * d + 4 * d) + (d + 4 * d) * d) * 2 + 4 * L * L * d
    return cfg.num_layers * double + cfg.num_single_layers * single


res["flops_per_step_formula"] = flops_per_step()
for wd in os.environ.get("WEIGHTS", "int8").split(","):
    t0 = time.perf_counter()
    opts = LoadOptions(weights_dtype=None if wd == "bf16" else wd, weights_layers="linear")  # 11.1 GiB (docs/tpu.md plan)
    model = build_flux_transformer(cfg, Views(shapes), jnp.bfloat16, "random", opts)
    jax.block_until_ready(model.params)
    r = res.setdefault(wd, {"load_s": round(time.perf_counter() - t0, 1)})
    mem = jax.devices()[0].memory_stats() or {}
    r["weights_bytes_in_use"] = mem.get("bytes_in_use")
    print(wd, "loaded", r, flush=True)
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(1, TOK, cfg.in_channels), jnp.bfloat16)
    ctx = jnp.asarray(rng.randn(1, TXT, cfg.joint_attention_dim), jnp.bfloat16)
    pooled = jnp.asarray(rng.randn(1, cfg.pooled_projection_dim), jnp.bfloat16)
    t = jnp.asarray([0.5], jnp.float32)
    img_ids = jnp.zeros((TOK, 3), jnp.float32)
    txt_ids = jnp.zeros((TXT, 3), jnp.float32)
    g = jnp.asarray([3.5], jnp.float32)
    for fences in os.environ.get("FENCES", "off,on").split(","):
        os.environ["PREHEAT_FENCES"] = fences
        f = jax.jit(lambda p, *a: model.apply(p, *a))
        t0 = time.perf_counter()
        compiled = f.lower(model.params, x, ctx, pooled, t, img_ids, txt_ids, g).compile()
        tc = time.perf_counter() - t0
        args = (model.params, x, ctx, pooled, t, img_ids, txt_ids, g)
        out = jax.block_until_ready(compiled(*args))
        ts = []
        for _ in range(6 if not DRY else 2):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            ts.append(time.perf_counter() - t0)
        med = statistics.median(ts)
        mem = jax.devices()[0].memory_stats() or {}
        r[f"fences_{fences}"] = {"compile_s": round(tc, 1), "median_ms": round(med * 1e3, 2),
                                 "min_ms": round(min(ts) * 1e3, 2), "max_ms": round(max(ts) * 1e3, 2),
                                 "tflops": round(res["flops_per_step_formula"] / med * 1e-12, 1),
                                 "peak_bytes": mem.get("peak_bytes_in_use"),
                                 "finite": bool(np.isfinite(np.asarray(out, np.float32)).all())}
        print(wd, fences, r[f"fences_{fences}"], flush=True)
        dump()
        del compiled
    del model
dump()
print(json.dumps(res), flush=True)
