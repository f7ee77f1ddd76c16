"""FLUX.1-dev's int8 weights on the chip against float32 on the host: the relative error, block by block.

    python3 scripts/flux_quality_tpu.py [--folder F] [--size 1024] [--double 2] [--single 2] > $OUT/flux_quality.jsonl
    JAX_PLATFORMS=cpu python3 scripts/flux_quality_tpu.py --dry       # this script's own check, on a CPU

The first blocks of the random FLUX.1-dev folder (``bench.random_weights``: full width, the
matrices stored in fp8; the one ``scripts/tpu_check.py``'s flux rows write when it is there, else a
folder of those blocks alone, about 1 GB: a tensor's random values depend on its shape only) are
loaded three times: float32 on the host's CPU (the reference, run there: ``platforms.on_host``),
int8 with per-channel scales on the chip as the chip's rows run it (``--dtype bfloat16
--weights-dtype int8 --weights-layers linear``), and bfloat16 on the chip (what the int8 error adds
to; the file's fp8 values are exact in bfloat16, so this is the activations' rounding alone). Each takes the first step's inputs of a 1024² image (sigma 1: the latent noise; T5's 512 tokens
and CLIP's pooled vector drawn at random, not encoded; guidance 3.5), and the model cut after 1, 2,
... of its blocks (double, then single; ``norm_out`` and ``proj_out`` after the last) gives its
velocity. One JSON object: per depth, ``|chip - host| / |host|`` over the whole prediction for int8
and for bf16, printed a line at a time (the load, then each depth as it is done, then the whole
object), so a call cut short keeps what it measured. The float32 reference reads the guidance scale
as the bfloat16 programs do (``models.flux.thousandfold``: 3.5 x 1000 is 3504 in bfloat16).
``--parts`` adds the first block's intermediates, chip against host. Measured on the v5e: the
folder of blocks written in 8-10 s, loaded in 6-9 s, then 22, 29, 37 and 49 s for the four depths.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def _subset(params: Any, doubles: int, singles: int) -> Any:
    """The parameters of the first ``doubles`` double and ``singles`` single blocks and the rest."""
    from flax import nnx

    def keep(path: tuple[Any, ...]) -> bool:
        if path[0] == "transformer_blocks":
            return int(path[1]) < doubles
        if path[0] == "single_transformer_blocks":
            return int(path[1]) < singles
        return True

    return nnx.from_flat_state([(path, var) for path, var in nnx.to_flat_state(params) if keep(path)])


def _load(folder: Path, config: Any, dtype: str, device: Any, weights_dtype: str | None) -> Any:
    """The first blocks of ``folder``'s transformer (``config``'s), placed on ``device``."""
    import jax

    from preheat.models.flux import build_flux_transformer
    from preheat.models.safetensors_files import DIFFUSERS_STEM, read_tensors, weight_files
    from preheat.models.weights import LoadOptions

    tensors = read_tensors(weight_files(folder / "transformer", (DIFFUSERS_STEM,)))
    for key in list(tensors):
        parts = key.split(".")
        if (parts[0] == "transformer_blocks" and int(parts[1]) >= config.num_layers) or \
                (parts[0] == "single_transformer_blocks" and int(parts[1]) >= config.num_single_layers):
            del tensors[key]  # hidden: never read
    options = LoadOptions(weights_dtype=weights_dtype, weights_layers="linear", device=device)
    model = build_flux_transformer(config, tensors, dtype, str(folder), options)
    return model, jax.device_put(model.params, device)  # committed there: the program runs there


def _inputs(config: Any, size: int, rng: Any) -> tuple[Any, ...]:
    """The first step's inputs of a ``size``² image: (tokens, context, pooled, sigma, img ids, txt ids, guidance)."""
    import numpy as np

    from preheat.models.flux import latent_image_ids

    h = size // 8  # latents a side (the 8x VAE); tokens are their 2x2 patches
    s = (h // 2) ** 2
    return (rng.standard_normal((1, s, config.in_channels)).astype(np.float32),
            rng.standard_normal((1, 512, config.joint_attention_dim)).astype(np.float32),
            rng.standard_normal((1, config.pooled_projection_dim)).astype(np.float32),
            np.ones((1,), np.float32), latent_image_ids(h, h).astype(np.float32), np.zeros((512, 3), np.float32),
            np.full((1,), 3.5, np.float32) if config.guidance_embeds else None)


def _as_bfloat16_sees(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """``inputs`` with the guidance scale the float32 reference takes moved to what the bfloat16
    program embeds: diffusers (and ``FluxTransformerModule``) multiply it by 1000 in the model's
    dtype, so 3.5 becomes 3504 in bfloat16, not 3500, and the sinusoids of 3500 and 3504 differ (the
    float32 model's own prediction moves 27% between the two at one block). That is the model's
    reading of its input, not an error of its weights or activations, so the reference reads it too.
    The timestep (sigma 1: 1000) is exact in both."""
    import jax.numpy as jnp
    import numpy as np

    from preheat.models.flux import thousandfold

    guidance = inputs[6]
    if guidance is None:
        return inputs
    seen = np.asarray(thousandfold(jnp.asarray(guidance), jnp.bfloat16), np.float32)  # 3504
    scale = (seen / np.float32(1000)).astype(np.float32)
    assert np.array_equal(scale * np.float32(1000), seen), (scale, seen)  # float32 x 1000 lands on it exactly
    return (*inputs[:6], scale)


def _predict(model: Any, params: Any, config: Any, doubles: int, singles: int, inputs: tuple[Any, ...],
             device: Any, host: bool) -> Any:
    """The velocity of the model cut after ``doubles`` + ``singles`` blocks, on ``device``, as float64."""
    import contextlib

    import jax
    import numpy as np

    from preheat import platforms
    from preheat.models.flux import FluxTransformer, build_abstract

    cut = replace(config, num_layers=doubles, num_single_layers=singles)
    graphdef, _ = build_abstract(cut)
    part = FluxTransformer(cut, graphdef, None, model.dtype)
    args = jax.device_put([a for a in inputs if a is not None], device)
    guidance = args[6] if len(args) == 7 else None
    with platforms.on_host() if host else contextlib.nullcontext():
        out = jax.jit(part.apply)(_subset(params, doubles, singles), *args[:6], guidance)
    return np.asarray(out, np.float64)


def _parts(model: Any, params: Any, config: Any, inputs: tuple[Any, ...], device: Any, host: bool) -> dict[str, Any]:
    """The first double block's intermediates on ``device``, as float64: the timestep's and the
    guidance's float32 sinusoids (large arguments: 1000 and 3504 radians at most), the time
    embedding, the two embedders, the rotary tables, the adaLN-modulated input, the attention's and the block's outputs
    (where a chip's prediction parts from the host's, when the whole one does)."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from preheat import platforms
    from preheat.models.flux import build_abstract, rope_cos_sin, thousandfold
    from preheat.models.layers import sinusoidal_embedding
    from preheat.models.storage import upcast

    cut = replace(config, num_layers=1, num_single_layers=0)
    graphdef, _ = build_abstract(cut)

    def run(p: Any, x: Any, context: Any, pooled: Any, t: Any, img_ids: Any, txt_ids: Any, guidance: Any) -> Any:
        m = nnx.merge(graphdef, upcast(p, model.dtype, tie=x))
        x, context, pooled = (v.astype(model.dtype) for v in (x, context, pooled))
        g = None if guidance is None else thousandfold(guidance, model.dtype)  # as FluxTransformerModule does
        temb = m.time_text_embed(thousandfold(t, model.dtype), g, pooled)  # (B, C)
        sinusoids = {"t_sinusoids": sinusoidal_embedding(thousandfold(t, model.dtype), 256, True, 0)}  # float32 sin/cos
        if g is not None:  # of 1000 and 3504 (3.5 x 1000 in bf16): large arguments
            sinusoids["guidance_sinusoids"] = sinusoidal_embedding(g, 256, True, 0)
        h, ctx = m.x_embedder(x), m.context_embedder(context)  # (B, S, C), (B, T, C)
        cos, sin = rope_cos_sin(jnp.concatenate([txt_ids, img_ids], axis=0), cut.axes_dims_rope)
        block = m.transformer_blocks[0]
        normed = block.norm1(h, temb)[0]
        attn_image, attn_text = block.attn(normed, block.norm1_context(ctx, temb)[0], cos, sin)
        text, image = block(h, ctx, temb, cos, sin)
        return {**sinusoids, "temb": temb, "x_embed": h, "context_embed": ctx, "rope_cos": cos, "rope_sin": sin,
                "norm1_image": normed, "attn_image": attn_image, "attn_text": attn_text,
                "block_text": text, "block_image": image}

    args = jax.device_put([a for a in inputs if a is not None], device)
    guidance = args[6] if len(args) == 7 else None
    with platforms.on_host() if host else contextlib.nullcontext():
        out = jax.jit(run)(_subset(params, 1, 0), *args[:6], guidance)
    return {name: np.asarray(v, np.float64) for name, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="a FLUX.1-dev folder (default: the random one, written under --work)")
    parser.add_argument("--work", default="/tmp/preheat-tpu-check")
    parser.add_argument("--size", type=int, default=1024, help="image side (1024: 4096 image tokens)")
    parser.add_argument("--double", type=int, default=2, choices=(1, 2), help="double blocks (unscanned: at most 2)")
    parser.add_argument("--single", type=int, default=2, choices=(0, 1, 2), help="single blocks after them")
    parser.add_argument("--parts", action="store_true",
                        help="also the first block's intermediates, each against the host's (where an error starts)")
    parser.add_argument("--dry", action="store_true", help="on the CPU, a small folder: this script's check")
    args = parser.parse_args(argv)
    if args.dry:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np

    from preheat import platforms
    from preheat.bench.random_weights import SMALL_FLUX, write_random_folder
    from preheat.models.flux import read_flux_config

    t0 = time.monotonic()
    full = Path(args.work) / "random-flux-dev"  # tpu_check's flux rows' folder, when they ran here
    if args.folder:
        folder = Path(args.folder)
    elif args.dry:
        folder = write_random_folder("flux-dev", Path(args.work) / "random-flux-dev-dry", configs=SMALL_FLUX)
    elif (full / "model_index.json").is_file():
        folder = full
    else:  # the first blocks alone, full width: each tensor's values depend on its shape only, so they are
        #     the full folder's first blocks (the encoders and VAE small: never loaded here)
        small = {k: v for k, v in SMALL_FLUX.items() if k != "transformer"}
        folder = write_random_folder("flux-dev", Path(args.work) / "random-flux-dev-blocks", configs={
            **small, "transformer": {"num_layers": args.double, "num_single_layers": args.single}})
    size = 64 if args.dry else args.size
    config = read_flux_config(folder / "transformer")
    args.double, args.single = min(args.double, config.num_layers), min(args.single, config.num_single_layers)
    config = replace(config, num_layers=args.double, num_single_layers=args.single)
    host, chip = platforms.host_device(), jax.devices()[0]
    result: dict[str, Any] = {"folder": str(folder), "size": size, "device": chip.device_kind,
                              "host": platforms.describe_device(host)["device"], "write_s": round(time.monotonic() - t0, 1)}
    t1 = time.monotonic()
    loaded = {"float32 host": _load(folder, config, "float32", host, None),
              "int8 chip": _load(folder, config, "bfloat16", chip, "int8"),
              "bfloat16 chip": _load(folder, config, "bfloat16", chip, None)}
    result["load_s"] = round(time.monotonic() - t1, 1)
    print(json.dumps(result), flush=True)
    inputs = _inputs(config, size, np.random.default_rng(0))
    inputs_of = {name: _as_bfloat16_sees(inputs) if name.endswith("host") else inputs for name in loaded}
    depths = [(d, 0) for d in range(1, args.double + 1)] + [(args.double, s) for s in range(1, args.single + 1)]
    rows = []
    for doubles, singles in depths:
        t2 = time.monotonic()
        out = {name: _predict(model, params, config, doubles, singles, inputs_of[name],
                              host if name.endswith("host") else chip, name.endswith("host"))
               for name, (model, params) in loaded.items()}
        ref = out["float32 host"]
        norm = float(np.linalg.norm(ref))
        rows.append({"blocks": f"{doubles} double + {singles} single", "host_norm": norm,
                     "finite": bool(all(np.isfinite(o).all() for o in out.values())),
                     **{f"rel_err_{name.split()[0]}": float(np.linalg.norm(o - ref) / norm) if norm else None
                        for name, o in out.items() if name != "float32 host"},
                     "s": round(time.monotonic() - t2, 1)})
        print(json.dumps(rows[-1]), flush=True)  # each depth as it is done: a call cut short keeps them
    result["depths"] = rows
    if args.parts:
        parts = {name: _parts(model, params, config, inputs_of[name], host if name.endswith("host") else chip,
                              name.endswith("host"))
                 for name, (model, params) in loaded.items()}
        ref = parts["float32 host"]
        result["parts"] = {part: {"host_norm": float(np.linalg.norm(ref[part])),
                                  **{f"rel_err_{name.split()[0]}": float(np.linalg.norm(got[part] - ref[part]) /
                                                                         max(np.linalg.norm(ref[part]), 1e-30))
                                     for name, got in parts.items() if name != "float32 host"}}
                           for part in ref}
        print(json.dumps({"parts": result["parts"]}), flush=True)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
