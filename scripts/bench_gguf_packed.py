"""GGUF FLUX.1 files of each quantisation type on the JAX engine, at FLUX.1's full widths with few blocks:

    python scripts/bench_gguf_packed.py [--double 1] [--single 1] [--rounds 5] [--tokens 64] [--work DIR]

A random ``FluxTransformer2DModel`` at FLUX.1-dev's widths (24 heads x 128, T5 width 4096, pooled
768) with ``--double`` / ``--single`` blocks is written as a city96-style GGUF file per type (BFL's
keys, every 2-D weight whose rows are whole blocks in the type, the rest F16/F32;
``tests/_support/gguf_files``). For each file, in this process:

* ``convert_s``: ``single_file.materialize`` (the bytes moved into a diffusers folder, once);
* ``load_s``: ``flux.load_flux_transformer`` of that folder (the blocks placed on the device);
* ``device_bytes``: what the loaded denoiser holds (``storage.device_bytes``), beside the file's size;
* ``step_s``: one jitted denoiser call (``--tokens`` image tokens, 64 text tokens, batch 1, float32),
  ``--rounds`` rounds, the types round-robin so that a noisy machine slows them alike; the
  median, min and max, and the median's ratio to Q8_0's.

``--h200`` instead prints the kernels one FLUX.1-width Linear (3072 -> 3072, bias, 4096 tokens, bf16
compute, as a denoiser's apply runs it: ``storage.upcast`` with the step's tie, then ``layers.Linear``)
compiles to per type, read from the HLO XLA compiles for its H200 description on this machine (a
deviceless compile: not autotuned; needs the test extra's jax-cuda13-plugin), with the bytes each
kernel writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "Q3_K", "Q2_K")


def h200_kernels(kinds: list[str]) -> None:
    """Each type's Linear on the deviceless H200: its kernels and the bytes each writes."""
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiled for the H200 description, run nowhere
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from preheat.bench.fp8 import kernels, written_bytes
    from preheat.cache import targets
    from preheat.cache.compile import on_device
    from preheat.platforms import compiling_for
    from preheat.models.ggml import LAYOUTS
    from preheat.models.layers import Linear
    from preheat.models.quantised import Packed, Quantised
    from preheat.models.storage import upcast
    from preheat.models.weights import build_abstract

    width, tokens = 3072, 4096
    device = targets.target_device(targets.resolve_target("h200"))
    for kind in kinds:
        graphdef, abstract = build_abstract(lambda rngs: Linear(width, width, rngs=rngs))
        if kind == "Q8_0":  # int8 values beside float16 scales per 32 along the input
            weight = Quantised(jax.ShapeDtypeStruct((width, width), jnp.int8),
                               jax.ShapeDtypeStruct((width // 32, width), jnp.float16))
        else:  # the blocks as bytes, (in / QK, BYTES, out)
            layout = LAYOUTS[kind]
            weight = Packed(jax.ShapeDtypeStruct((width // layout.qk, layout.nbytes, width), jnp.uint8), kind)
        abstract["kernel"].set_value(weight)
        abstract["bias"].set_value(jax.ShapeDtypeStruct((width,), jnp.bfloat16))
        x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)

        def layer(params, x):  # (tokens, in) -> (tokens, out)
            return nnx.merge(graphdef, upcast(params, jnp.bfloat16, tie=x))(x)

        with compiling_for("gpu", (9, 0)):
            hlo = jax.jit(layer).lower(*on_device((abstract, x), device)).compile().as_text()
        found = kernels(hlo)
        print(json.dumps({"kind": kind, "weight_bytes": sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(weight)), "kernels": len(found),
                          "written": [(k.output, written_bytes(k), "gemm" if k.gemm else "") for k in found]}),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--double", type=int, default=1)
    parser.add_argument("--single", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="image tokens per call (64: a 128x128 image)")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--h200", action="store_true", help="each type's Linear kernels on the deviceless H200")
    args = parser.parse_args()
    if args.h200:
        return h200_kernels(args.kinds.split(","))
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-gguf-packed-"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import gguf
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import FluxTransformer2DModel

    from preheat.models.flux import load_flux_transformer
    from preheat.models.single_file import materialize
    from preheat.models.storage import device_bytes
    from tests._support.bfl_files import to_bfl, transformer_config_folder
    from tests._support.gguf_files import write_gguf

    torch.manual_seed(0)
    model = FluxTransformer2DModel(num_layers=args.double, num_single_layers=args.single, guidance_embeds=True)
    configs = transformer_config_folder(work / "configs", model)
    bfl = to_bfl({k: v.detach().numpy() for k, v in model.state_dict().items()})
    params = sum(v.size for v in bfl.values())
    del model
    rows: dict[str, dict] = {}
    loaded = {}
    for kind in args.kinds.split(","):
        file = work / f"flux1-bench-{kind}.gguf"
        t = time.perf_counter()
        types = write_gguf(file, bfl, gguf.GGMLQuantizationType[kind])
        row = {"write_s": round(time.perf_counter() - t, 1), "file_bytes": file.stat().st_size,
               "tensors_in_type": list(types.values()).count(kind)}
        t = time.perf_counter()
        folder = materialize(file, configs, work / "home")
        row["convert_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        denoiser = load_flux_transformer(folder / "transformer", jnp.float32)
        jax.block_until_ready(jax.tree.leaves(denoiser.params))
        row["load_s"] = round(time.perf_counter() - t, 2)
        row["device_bytes"] = device_bytes(denoiser.params)
        loaded[kind] = denoiser
        rows[kind] = row
        print(kind, row, flush=True)
    del bfl

    cfg = next(iter(loaded.values())).config
    rng = np.random.default_rng(0)
    s, txt = args.tokens, 64
    inputs = (jnp.asarray(rng.standard_normal((1, s, 64)), jnp.float32),
              jnp.asarray(rng.standard_normal((1, txt, cfg.joint_attention_dim)), jnp.float32),
              jnp.asarray(rng.standard_normal((1, cfg.pooled_projection_dim)), jnp.float32),
              jnp.asarray([0.5], jnp.float32), jnp.zeros((s, 3), jnp.float32), jnp.zeros((txt, 3), jnp.float32),
              jnp.asarray([3.5], jnp.float32))
    calls = {}
    for kind, d in loaded.items():
        call = jax.jit(d.apply)
        t = time.perf_counter()
        jax.block_until_ready(call(d.params, *inputs))
        rows[kind]["first_call_s"] = round(time.perf_counter() - t, 2)
        calls[kind] = call
    times: dict[str, list[float]] = {k: [] for k in loaded}
    for _ in range(args.rounds):
        for kind, d in loaded.items():
            t = time.perf_counter()
            jax.block_until_ready(calls[kind](d.params, *inputs))
            times[kind].append(time.perf_counter() - t)
    base = statistics.median(times["Q8_0"]) if "Q8_0" in times else None
    for kind, ts in times.items():
        med = statistics.median(ts)
        rows[kind].update(step_median_s=round(med, 3), step_min_s=round(min(ts), 3), step_max_s=round(max(ts), 3),
                          step_vs_q8_0=round(med / base, 2) if base else None)
    print(json.dumps({"double": args.double, "single": args.single, "params": int(params), "tokens": s,
                      "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
