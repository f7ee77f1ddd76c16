"""Where T5-XXL costs least beside FLUX.1's transformer on a TPU chip (issue 59): its 24 blocks (d_model
4096, d_ff 10240, 64 heads of 64, gated GELU; random weights, timing only), batch 1, 256 and 512 tokens,
bf16 and int8 weights (int8: per-channel scales, converted in the product):

    A  one program, the stacked weights in pinned host memory, each block's slice moved to the chip
       inside the scan (the transfer ``--encoders-on offload`` compiles through ``storage.upcast``)
    B  a Python loop over one block program, the next block's transfer issued before this one's
       result is awaited (two blocks on the chip), from numpy and from pinned host memory
    C  every block resident on the chip (the compute floor; does not fit beside the transformer)

and the host-to-chip rates (numpy, pinned, inside a program). JSON lines on stdout; median/min/max of 2.

    python3 benchmarks/tpu_t5_stream.py 24                       # ~3.5 min on a v5e (the bf16 half ~2.5)
    JAX_PLATFORMS=cpu python3 benchmarks/tpu_t5_stream.py 2      # the script's check (~1.5 min)

Results: docs/tpu.md ("Where T5 costs least").
"""
import json, sys, time
import numpy as np
import jax, jax.numpy as jnp
import ml_dtypes

D, H, DK, F, N = 4096, 64, 64, 10240, int(sys.argv[1]) if len(sys.argv) > 1 else 24
dev = jax.devices()[0]
print(json.dumps({"devices": str(jax.devices()), "memories": [str(m) for m in dev.addressable_memories()]}), flush=True)
kinds = {m.kind for m in dev.addressable_memories()}
host_kind = "pinned_host" if "pinned_host" in kinds else "unpinned_host"
HOST = jax.sharding.SingleDeviceSharding(dev, memory_kind=host_kind)
DEV = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
SHAPES = {"q": (D, H * DK), "k": (D, H * DK), "v": (D, H * DK), "o": (H * DK, D),
          "wi0": (D, F), "wi1": (D, F), "wo": (F, D)}


def timed(fn, n=2):
    out = fn(); jax.block_until_ready(out)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); jax.block_until_ready(fn()); ts.append(time.perf_counter() - t)
    return float(np.median(ts)), min(ts), max(ts)


def bandwidth():
    a = np.ones((1024, 1024, 512), ml_dtypes.bfloat16)  # 1 GiB
    res = {}
    res["numpy_to_device_GBps"] = 2**30 / timed(lambda: jax.device_put(a, DEV))[0] / 1e9
    h = jax.device_put(a, HOST); jax.block_until_ready(h)
    res["host_kind"] = host_kind
    res["pinned_to_device_GBps"] = 2**30 / timed(lambda: jax.device_put(h, DEV))[0] / 1e9
    g = jax.jit(lambda x: x * 2, out_shardings=DEV)
    res["in_program_pinned_to_device_GBps"] = None
    try:
        f = jax.jit(lambda x: jax.device_put(x, DEV) * 2, in_shardings=HOST, out_shardings=DEV)
        res["in_program_pinned_to_device_GBps"] = 2**30 / timed(lambda: f(h))[0] / 1e9
    except Exception as e:
        res["in_program_error"] = str(e)[:300]
    del h
    return res


def weights(dtype, n):
    base = {k: (np.random.default_rng(0).standard_normal(s).astype(np.float32) * 0.02) for k, s in SHAPES.items()}
    if dtype == "int8":
        w = {k: np.broadcast_to(np.clip(np.round(v / 0.0005), -127, 127).astype(np.int8), (n, *v.shape))
             for k, v in base.items()}
        s = {k: np.full((n, 1, v.shape[1]), 0.0005, np.float32) for k, v in base.items()}
        return {k: (np.ascontiguousarray(w[k]), s[k]) for k in w}
    return {k: (np.ascontiguousarray(np.broadcast_to(v.astype(ml_dtypes.bfloat16), (n, *v.shape))), None)
            for k, v in base.items()}


def mat(x, ws):
    w, s = ws
    if s is None:
        return x @ w
    return (x @ w.astype(jnp.bfloat16)) * s.astype(jnp.bfloat16)


def block(h, w, bias):  # h (B, L, D) bf16
    x = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(h.dtype)
    b, l, _ = x.shape
    q, k, v = (mat(x, w[n]).reshape(b, l, H, DK) for n in "qkv")
    s = jnp.einsum("blhd,bmhd->bhlm", q, k).astype(jnp.float32) + bias
    a = jnp.einsum("bhlm,bmhd->blhd", jax.nn.softmax(s, -1).astype(x.dtype), v).reshape(b, l, H * DK)
    h = h + mat(a, w["o"])
    x = h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(h.dtype)
    return h + mat(jax.nn.gelu(mat(x, w["wi0"]), approximate=True) * mat(x, w["wi1"]), w["wo"])


def run(dtype, tokens, n, w):
    out = {"dtype": dtype, "tokens": tokens, "blocks": n}
    nbytes = sum(a.nbytes + (0 if s is None else s.nbytes) for a, s in w.values())
    out["weights_GB"] = nbytes / 1e9
    x = jnp.ones((1, tokens, D), jnp.bfloat16)
    bias = jnp.zeros((1, H, tokens, tokens), jnp.float32)
    # (A) one program, weights in host memory, sliced and moved inside the scan
    try:
        wh = jax.device_put(w, HOST); jax.block_until_ready(wh)

        def streamed(wh, x, bias):
            def body(h, wi):
                wi = jax.device_put(wi, DEV)
                return block(h, wi, bias), None
            return jax.lax.scan(body, x, wh)[0]
        t = time.perf_counter()
        fa = jax.jit(streamed, out_shardings=DEV).lower(wh, x, bias).compile()
        out["A_compile_s"] = time.perf_counter() - t
        ma = fa.memory_analysis()
        out["A_temp_GB"] = getattr(ma, "temp_size_in_bytes", 0) / 1e9
        out["A_s"] = timed(lambda: fa(wh, x, bias))
        ref_a = np.asarray(fa(wh, x, bias).astype(jnp.float32))
        del wh
    except Exception as e:
        out["A_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        ref_a = None
    # (B) Python loop: one block program, the next block's transfer issued before this block's result is awaited
    one = jax.jit(block)
    host_blocks = [{k: (a[i], None if s is None else s[i]) for k, (a, s) in w.items()} for i in range(n)]
    try:
        def looped(blocks):
            h = x
            nxt = jax.device_put(blocks[0], DEV)
            for i in range(n):
                cur = nxt
                if i + 1 < n:
                    nxt = jax.device_put(blocks[i + 1], DEV)
                h = one(h, cur, bias)
                if i + 1 < n:
                    h.block_until_ready()  # at most two blocks on the chip
            return h
        out["B_s"] = timed(lambda: looped(host_blocks))
        pinned_blocks = [jax.device_put(b, HOST) for b in host_blocks]  # pinned copies as the source
        jax.block_until_ready(pinned_blocks)
        out["B_pinned_s"] = timed(lambda: looped(pinned_blocks))
        del pinned_blocks
    except Exception as e:
        out["B_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    # (C) all on the chip
    try:
        wd = jax.device_put(w, DEV)
        fc = jax.jit(lambda wd, x, bias: jax.lax.scan(lambda h, wi: (block(h, wi, bias), None), x, wd)[0])
        out["C_s"] = timed(lambda: fc(wd, x, bias))
        if ref_a is not None:
            out["A_vs_C_maxdiff"] = float(np.max(np.abs(ref_a - np.asarray(fc(wd, x, bias).astype(jnp.float32)))))
        del wd
    except Exception as e:
        out["C_error"] = f"{type(e).__name__}: {str(e)[:400]}"
    print(json.dumps(out), flush=True)


print(json.dumps(bandwidth()), flush=True)
for dtype in ("bfloat16", "int8"):
    w = weights(dtype, N)
    for tokens in (256, 512):
        run(dtype, tokens, N, w)
    del w
print(json.dumps({"peak_GB": dev.memory_stats().get("peak_bytes_in_use", 0) / 1e9 if dev.memory_stats() else None}))
