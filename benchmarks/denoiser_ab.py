"""One denoiser call of a pixel model, the model-code switches side by side in one process.

Each variant is traced and compiled under its setting (``PREHEAT_CONV``, ``PREHEAT_GROUPNORM``,
bf16 weights and activations), then all of them and diffusers' UNet under torch.compile are
timed round-robin, so drifting load hits every one alike. Prints per variant the median (min–max)
call time, the speed against the first variant (ratio of minima / of medians) and the largest
output difference from it. The numbers behind docs/benchmarks.md, issue 21.

    python benchmarks/denoiser_ab.py [MODEL] [--rounds 15] [--variant NAME=SETTINGS ...] [--json-out F]

MODEL: a pixel-UNet folder, ``ddpm-cifar10-32`` (random weights), or nothing for the built-in
model. SETTINGS: comma-separated ``conv=IMPL``, ``groupnorm=IMPL``, ``dtype=bfloat16``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

DEFAULT_VARIANTS = ("two_pass=groupnorm=two_pass", "two_pass_again=groupnorm=two_pass", "one_pass=groupnorm=one_pass",
                    "taps=conv=taps,groupnorm=one_pass", "im2col=conv=im2col,groupnorm=one_pass",
                    "bf16=dtype=bfloat16,groupnorm=one_pass")


def _settings(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in ("conv", "groupnorm", "dtype") or not value:
            raise SystemExit(f"error: variant setting {part!r} must be conv=, groupnorm= or dtype=")
        out[name] = value
    return out


def _compile(pipe: Any, x: Any, t: Any, cond: Any, settings: dict[str, str]) -> Callable[[], Any]:
    """The denoiser call traced under ``settings`` (the switches are read at trace time)."""
    import jax
    import jax.numpy as jnp

    env = {"PREHEAT_CONV": settings.get("conv", "auto"), "PREHEAT_GROUPNORM": settings.get("groupnorm", "auto")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    jax.clear_caches()  # a trace is cached per function: trace again under these settings
    try:
        dtype = settings.get("dtype")
        params = pipe.params if dtype is None else jax.tree.map(
            lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, pipe.params)
        xv = x if dtype is None else x.astype(dtype)
        fn = jax.jit(pipe.apply).lower(params, xv, t, cond).compile()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return lambda: fn(params, xv, t, cond)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--variant", action="append", help="NAME=SETTINGS (repeatable; the first is the baseline)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import preheat
    from preheat.bench.random_models import materialize_model
    from benchmarks.op_profile import torch_breakdown
    from preheat.engine import BUILTIN_MODEL

    variants = [v.partition("=") for v in (args.variant or DEFAULT_VARIANTS)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(materialize_model(args.model, Path(tmp)) or BUILTIN_MODEL)
        pipe = preheat.load(str(folder), cache="off")
        sig, call_args = pipe.prepare(8, steps=2, seed=0)  # batch 8 (16 rows under guidance)
        cond = call_args[3]
        if sig.guided:
            cond = jax.tree.map(lambda c, u: jnp.concatenate([c, u]), call_args[3], call_args[4])
        n = 16 if sig.guided else 8
        x = jax.random.normal(jax.random.key(0), (n, *sig.sample_shape), jnp.float32)  # (N, H, W, C)
        t = jnp.full((n,), 500.0, jnp.float32)
        calls = {name: _compile(pipe, x, t, cond, _settings(text)) for name, _, text in variants}
        unet_dir = folder / "unet" if (folder / "unet").is_dir() else folder
        labels = cond.get("class_labels") if isinstance(cond, dict) else None
        torch_side = torch_breakdown(str(unet_dir), np.asarray(x).transpose(0, 3, 1, 2).copy(),
                                     np.asarray(t).astype(np.int64),
                                     None if labels is None else np.asarray(labels).astype(np.int64), {}, 2)
    baseline = variants[0][0]
    outputs = {name: np.asarray(call().astype(jnp.float32)) for name, call in calls.items()}
    outputs["torch.compile"] = torch_side["call"]().numpy().transpose(0, 2, 3, 1)  # NCHW -> NHWC
    calls["torch.compile"] = torch_side["call"]
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            out = call()
            if hasattr(out, "block_until_ready"):
                out.block_until_ready()
            times[name].append(time.perf_counter() - start)
    base = times[baseline]
    result = {"model": str(args.model or "built-in"), "model_batch": n, "rounds": args.rounds,
              "load_average": os.getloadavg()[0], "variants": {}}
    for name, ts in times.items():
        row = {"median_ms": 1e3 * float(np.median(ts)), "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
               "speed_min": min(base) / min(ts), "speed_median": float(np.median(base) / np.median(ts)),
               "max_abs_diff": float(np.abs(outputs[name] - outputs[baseline]).max())}
        result["variants"][name] = row
        print(f"{name:16s} {row['median_ms']:8.2f} ms ({row['min_ms']:.2f}–{row['max_ms']:.2f})  "
              f"speed vs {baseline}: {row['speed_min']:.2f} / {row['speed_median']:.2f}  "
              f"max|Δ| {row['max_abs_diff']:.2g}")
    print(f"load average {result['load_average']:.1f}")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
