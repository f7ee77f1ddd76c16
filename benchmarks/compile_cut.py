"""Issue 57 item 3, the cold compile cut: trace, lower and compile seconds of one denoiser call,
its transformer stages unrolled (one copy of each block in the program) against scanned
(``preheat.models.stacking``: one ``lax.scan`` over layer-stacked weights per stage of 3+ blocks).

Compile rows need only shapes: the weights are ``jax.ShapeDtypeStruct``s of the model's abstract
build, arguments of the program as in serving (never constants), through the loaded wrapper's
``apply`` (fp8 upcast and LoRA attach included, both empty here). Each (model, form) compiles in a
fresh process, so no in-process cache helps the second.

    sdxl   SDXL base 1.0's UNet, one call: batch 2 (CFG), 128x128 latents (1024x1024), bf16
    flux   FLUX.1-dev's transformer (19 + 38 blocks), one call: batch 1, 64x64 tokens, 512 text tokens
    sd3    SD3.5 large's transformer (38 joint blocks), one call: batch 2 (CFG), 128x128 latents, 333 text tokens
    clip   SDXL's encode stage: CLIP-L (12 layers) and OpenCLIP bigG (32) in one program, as the SD
           family's encode program (penultimate states by a clip_skip array, pooled projection):
           batch 2, 77 tokens, bf16
    t5     T5 v1.1 XXL's encoder (24 blocks; block 0 stays out of the scan), FLUX's encode: batch 1,
           512 tokens, bf16

``--steady`` times the running program instead (random weights, the unrolled and the scanned
program called in turn, median of each) and compares their outputs: ``tiny`` is a small SDXL-shaped
UNet with 4 blocks per transformer (CPU-sized), ``sdxl`` the whole SDXL UNet (for the chip).

    JAX_PLATFORMS=cpu python benchmarks/compile_cut.py --models sdxl,flux
    python benchmarks/compile_cut.py --models clip,t5
    python benchmarks/compile_cut.py --platform tpu --models sdxl,flux
    python benchmarks/compile_cut.py --platform tpu --steady sdxl --reps 10

Prints one JSON object per row as it goes, then a summary object (``"summary": true``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's preheat

from preheat.bench.random_models import SDXL_UNET  # noqa: E402 (the published config; no torch imported)

FORMS = ("unrolled", "scanned")
# "one-block": every stage one block deep, unrolled -- not a real model, the floor under any block
# scan (what the rest of the program costs); ask for it with --forms unrolled,scanned,one-block
TINY_DEEP_UNET: dict[str, Any] = dict(  # SDXL's layout at test widths, 4 blocks per transformer: scanned
    sample_size=32, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(64, 128),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=64, attention_head_dim=[2, 4], use_linear_projection=True, transformer_layers_per_block=[1, 4],
    addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=32 + 6 * 8,
    norm_num_groups=16)


def _platform(name: str) -> None:
    os.environ["JAX_PLATFORMS"] = name  # before jax is imported


def _unet(config: dict[str, Any], stacked: bool, batch: int, latent: int, pooled: int, dtype: Any):
    """(the loaded UNet on abstract weights, the abstract args of one call)."""
    import jax
    import jax.numpy as jnp

    from preheat.models.unet2d_condition import LoadedUNet2DCondition, UNet2DConditionConfig, build_abstract

    cfg = UNet2DConditionConfig.from_dict(config)
    graph, state = build_abstract(cfg, stacked=stacked)
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), state)
    unet = LoadedUNet2DCondition(config=cfg, graphdef=graph, params=state, dtype=dtype)
    sds = jax.ShapeDtypeStruct
    added = {"text_embeds": sds((batch, pooled), dtype), "time_ids": sds((batch, 6), jnp.float32)}
    args = (state, sds((batch, latent, latent, 4), dtype), sds((batch,), jnp.float32),
            sds((batch, 77, cfg.cross_attention_dim), dtype), added)
    return unet, args


def _flux(stacked: bool, batch: int, tokens: int, text: int, dtype: Any, one_block: bool = False):
    import jax
    import jax.numpy as jnp

    from preheat.models.flux import FluxTransformer, FluxTransformerConfig, build_abstract

    layers = dict(num_layers=1, num_single_layers=1) if one_block else {}
    cfg = FluxTransformerConfig.from_dict({**FLUX_DEV, **layers})
    graph, state = build_abstract(cfg, stacked=stacked)
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), state)
    model = FluxTransformer(config=cfg, graphdef=graph, params=state, dtype=dtype)
    sds = jax.ShapeDtypeStruct
    args = (state, sds((batch, tokens, cfg.in_channels), dtype), sds((batch, text, cfg.joint_attention_dim), dtype),
            sds((batch, cfg.pooled_projection_dim), dtype), sds((batch,), jnp.float32),
            sds((tokens, 3), jnp.float32), sds((text, 3), jnp.float32), sds((batch,), jnp.float32))
    return model.apply, args


# Published configs beside SDXL's (bench.random_models), here so the script needs only preheat's models.
FLUX_DEV: dict[str, Any] = dict(  # black-forest-labs/FLUX.1-dev transformer/config.json
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56))
SD35_LARGE: dict[str, Any] = dict(  # stabilityai/stable-diffusion-3.5-large transformer/config.json
    attention_head_dim=64, caption_projection_dim=2432, in_channels=16, joint_attention_dim=4096,
    num_attention_heads=38, num_layers=38, out_channels=16, patch_size=2, pooled_projection_dim=2048,
    pos_embed_max_size=192, qk_norm="rms_norm", sample_size=128)


def _sd3(stacked: bool, batch: int, latent: int, text: int, dtype: Any, one_block: bool = False):
    import jax
    import jax.numpy as jnp

    from preheat.models.sd3 import SD3Transformer, SD3TransformerConfig, build_abstract

    cfg = SD3TransformerConfig.from_dict({**SD35_LARGE, **(dict(num_layers=2) if one_block else {})})
    graph, state = build_abstract(cfg, stacked=stacked)
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), state)
    model = SD3Transformer(config=cfg, graphdef=graph, params=state, dtype=dtype)
    sds = jax.ShapeDtypeStruct
    args = (state, sds((batch, latent, latent, cfg.in_channels), dtype), sds((batch, text, cfg.joint_attention_dim), dtype),
            sds((batch, cfg.pooled_projection_dim), dtype), sds((batch,), jnp.float32))
    return model.apply, args


SDXL_CLIP_L: dict[str, Any] = dict(  # stabilityai/stable-diffusion-xl-base-1.0 text_encoder/config.json
    architectures=["CLIPTextModel"], hidden_act="quick_gelu", hidden_size=768, intermediate_size=3072,
    num_attention_heads=12, num_hidden_layers=12, projection_dim=768, max_position_embeddings=77,
    vocab_size=49408, eos_token_id=2)
SDXL_CLIP_G: dict[str, Any] = dict(  # text_encoder_2/config.json (OpenCLIP bigG)
    architectures=["CLIPTextModelWithProjection"], hidden_act="gelu", hidden_size=1280, intermediate_size=5120,
    num_attention_heads=20, num_hidden_layers=32, projection_dim=1280, max_position_embeddings=77,
    vocab_size=49408, eos_token_id=2)
T5_XXL: dict[str, Any] = dict(  # FLUX.1-dev text_encoder_2/config.json (T5 v1.1 XXL)
    d_ff=10240, d_kv=64, d_model=4096, dense_act_fn="gelu_new", feed_forward_proj="gated-gelu", is_gated_act=True,
    layer_norm_epsilon=1e-6, num_heads=64, num_layers=24, relative_attention_max_distance=128,
    relative_attention_num_buckets=32, vocab_size=32128)


def _sdxl_encode(stacked: bool, batch: int, dtype: Any):
    """SDXL's encode program (``families.stable_diffusion._encode_program`` with ``xl``) on abstract weights."""
    import jax
    import jax.numpy as jnp

    from preheat.models.clip import CLIPText, CLIPTextConfig, build_abstract, hidden_state_from_end

    encoders = []
    for raw in (SDXL_CLIP_L, SDXL_CLIP_G):
        cfg = CLIPTextConfig.from_dict({"model_type": "clip_text_model", **raw})
        graph, state = build_abstract(cfg, stacked=stacked)
        state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), state)
        encoders.append(CLIPText(config=cfg, graphdef=graph, params=state, dtype=dtype))

    def program(params: Any, ids: Any, skip: Any) -> Any:
        outs = [te.apply(p, i) for te, p, i in zip(encoders, params, ids)]
        context = jnp.concatenate([hidden_state_from_end(o, skip + 2) for o in outs], axis=-1)  # (B, 77, 2048)
        return context.astype(jnp.float32), outs[-1].text_embeds.astype(jnp.float32)

    sds = jax.ShapeDtypeStruct
    ids = sds((batch, 77), jnp.int32)
    return program, ([te.params for te in encoders], [ids, ids], sds((batch,), jnp.int32))


def _t5(stacked: bool, batch: int, text: int, dtype: Any):
    import jax
    import jax.numpy as jnp

    from preheat.models.t5 import T5Config, T5Encoder, build_abstract

    cfg = T5Config.from_dict({"model_type": "t5", "architectures": ["T5EncoderModel"], **T5_XXL})
    graph, state = build_abstract(cfg, stacked=stacked)
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), state)
    enc = T5Encoder(config=cfg, graphdef=graph, params=state, dtype=dtype)
    return enc.apply, (state, jax.ShapeDtypeStruct((batch, text), jnp.int32))


def compile_row(model: str, form: str) -> dict[str, Any]:
    """Trace, lower and compile one call of ``model`` in ``form``; seconds and the program's size."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_compilation_cache", False)

    stacked = form == "scanned"
    if form not in (*FORMS, "one-block"):
        raise SystemExit(f"unknown form {form!r}: unrolled, scanned or one-block")
    if model == "sdxl":
        config = dict(SDXL_UNET, transformer_layers_per_block=(1, 1, 1)) if form == "one-block" else SDXL_UNET
        unet, args = _unet(config, stacked, 2, 128, 1280, jnp.bfloat16)
        fn = unet.apply
        shape = "batch 2, 128x128 latents, bf16"
    elif model == "flux":
        fn, args = _flux(stacked, 1, 64 * 64, 512, jnp.bfloat16, one_block=form == "one-block")
        shape = "batch 1, 4096 image + 512 text tokens, bf16"
    elif model == "sd3":  # one-block: two blocks, a joint one and the last
        fn, args = _sd3(stacked, 2, 128, 333, jnp.bfloat16, one_block=form == "one-block")
        shape = "batch 2, 128x128 latents, 333 text tokens, bf16"
    elif model == "clip" and form != "one-block":
        fn, args = _sdxl_encode(stacked, 2, jnp.bfloat16)
        shape = "SDXL encode: CLIP-L + bigG, batch 2, 77 tokens, bf16"
    elif model == "t5" and form != "one-block":
        fn, args = _t5(stacked, 1, 512, jnp.bfloat16)
        shape = "T5-XXL encoder, batch 1, 512 tokens, bf16"
    else:
        raise SystemExit(f"unknown model {model!r} (form {form!r}): sdxl, flux, sd3, clip or t5")
    jax.jit(lambda x: x + 1).lower(jnp.zeros(2)).compile()  # the backend's start, outside the rows
    t0 = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    text = lowered.as_text()
    row = {"model": model, "form": form, "call": shape, "platform": jax.devices()[0].platform,
           "device": jax.devices()[0].device_kind, "trace_s": round(t1 - t0, 3), "lower_s": round(t2 - t1, 3),
           "compile_s": round(t3 - t2, 3), "total_s": round(t3 - t0, 3), "stablehlo_lines": text.count("\n"),
           "stablehlo_bytes": len(text)}
    try:
        mem = compiled.memory_analysis()
        row["temp_bytes"] = int(mem.temp_size_in_bytes)
    except Exception:  # not every backend reports it
        pass
    return row


def _random_params(abstract: Any, dtype: Any, seed: int) -> Any:
    """Small random weights (norm scales near 1) for every leaf of an abstract State."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    out = []
    for i, (path, var) in enumerate(nnx.to_flat_state(abstract)):
        s = var.get_value()
        key = jax.random.fold_in(jax.random.key(seed), i)
        noise = jax.random.normal(key, s.shape, jnp.float32) * 0.02
        base = 1.0 if str(path[-1]) == "scale" else 0.0
        out.append((path, var.replace((noise + base).astype(dtype))))
    return nnx.from_flat_state(out)


def _time(fn: Any, params: Any, inputs: Any, added: Any) -> tuple[float, float]:
    """Wall and this process's CPU seconds (all threads) of one call. On a shared CPU the second is
    the steadier (time spent waiting for a core another process holds is not counted)."""
    import jax

    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(params, *inputs, added))
    return time.perf_counter() - t0, time.process_time() - c0


def steady(name: str, reps: int, interleave: bool | None = None) -> dict[str, Any]:
    """Both programs on the same random weights; medians, their ratio, max |diff| of the outputs.

    ``tiny`` (CPU): both weight sets live, the programs called in turn (interleaved: a shared
    machine's load hits both alike). ``sdxl`` (the chip): one copy of the weights fits, so the
    unrolled program runs its reps first, then the same weights are stacked (``stacking.stack``
    consumes them, as a load does) and the scanned program runs its reps."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from preheat.models.stacking import stack
    from preheat.models.unet2d_condition import LoadedUNet2DCondition, UNet2DConditionModule

    config, latent, pooled, dtype = ((TINY_DEEP_UNET, 32, 32, jnp.float32) if name == "tiny"
                                     else (SDXL_UNET, 128, 1280, jnp.bfloat16))
    interleave = name == "tiny" if interleave is None else interleave
    abstract, args = _unet(config, False, 2, latent, pooled, dtype)
    cfg = abstract.config
    flat = LoadedUNet2DCondition(config=cfg, graphdef=abstract.graphdef, params=_random_params(args[0], dtype, 0),
                                 dtype=dtype)

    def scanned_from(params: Any) -> LoadedUNet2DCondition:
        graph, stacked = stack(lambda rngs: UNet2DConditionModule(cfg, rngs=rngs, stacked=True), params)
        return LoadedUNet2DCondition(config=cfg, graphdef=graph, params=stacked, dtype=dtype)

    rng = np.random.RandomState(1)
    inputs = [jnp.asarray(rng.randn(*a.shape).astype(np.float32)).astype(a.dtype) for a in args[1:4]]
    inputs[1] = jnp.full((2,), 500.0, jnp.float32)
    added = {"text_embeds": jnp.asarray(rng.randn(2, pooled), dtype),
             "time_ids": jnp.asarray([[1024, 1024, 0, 0, 1024, 1024]] * 2, jnp.float32)}
    wall: dict[str, list[float]] = {form: [] for form in FORMS}
    cpu: dict[str, list[float]] = {form: [] for form in FORMS}
    outs: dict[str, Any] = {}
    fn_u = jax.jit(flat.apply)
    outs["unrolled"] = np.asarray(fn_u(flat.params, *inputs, added).astype(jnp.float32))
    if interleave:
        scanned = scanned_from(_random_params(args[0], dtype, 0))  # the same values, a second copy
        fn_s = jax.jit(scanned.apply)
        outs["scanned"] = np.asarray(fn_s(scanned.params, *inputs, added).astype(jnp.float32))
        for _ in range(reps):
            for form, fn, p in (("unrolled", fn_u, flat.params), ("scanned", fn_s, scanned.params)):
                w, c = _time(fn, p, inputs, added)
                wall[form].append(w)
                cpu[form].append(c)
    else:
        for _ in range(reps):
            w, c = _time(fn_u, flat.params, inputs, added)
            wall["unrolled"].append(w)
            cpu["unrolled"].append(c)
        scanned = scanned_from(flat.params)  # flat's block weights are moved into the stacks
        fn_s = jax.jit(scanned.apply)
        outs["scanned"] = np.asarray(fn_s(scanned.params, *inputs, added).astype(jnp.float32))
        for _ in range(reps):
            w, c = _time(fn_s, scanned.params, inputs, added)
            wall["scanned"].append(w)
            cpu["scanned"].append(c)
    med = {form: statistics.median(ts) for form, ts in wall.items()}
    med_cpu = {form: statistics.median(ts) for form, ts in cpu.items()}
    return {"steady": name, "platform": jax.devices()[0].platform, "device": jax.devices()[0].device_kind,
            "reps": reps, "interleaved": interleave,
            "unrolled_median_s": round(med["unrolled"], 5), "scanned_median_s": round(med["scanned"], 5),
            "scanned_over_unrolled": round(med["scanned"] / med["unrolled"], 4),
            "unrolled_cpu_median_s": round(med_cpu["unrolled"], 5), "scanned_cpu_median_s": round(med_cpu["scanned"], 5),
            "cpu_scanned_over_unrolled": round(med_cpu["scanned"] / med_cpu["unrolled"], 4),
            "max_abs_diff": float(np.abs(outs["scanned"] - outs["unrolled"]).max()),
            "output_max_abs": float(np.abs(outs["unrolled"]).max())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--platform", default="cpu", help="cpu or tpu (JAX_PLATFORMS)")
    ap.add_argument("--models", default="sdxl", help="comma-separated: sdxl, flux, sd3, clip, t5")
    ap.add_argument("--forms", default=",".join(FORMS), help="comma-separated: unrolled, scanned")
    ap.add_argument("--steady", choices=("tiny", "sdxl"), help="time the running programs instead")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "FORM"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    _platform(a.platform)
    if a.one:
        print(json.dumps(compile_row(*a.one)), flush=True)
        return
    if a.steady:
        print(json.dumps(steady(a.steady, a.reps)), flush=True)
        return
    rows = []
    for model in a.models.split(","):
        for form in a.forms.split(","):
            done = subprocess.run([sys.executable, __file__, "--platform", a.platform, "--one", model, form],
                                  capture_output=True, text=True)
            if done.returncode:
                row = {"model": model, "form": form, "error": done.stderr.strip().splitlines()[-1:]}
            else:
                row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary: dict[str, Any] = {"summary": True}
    for model in a.models.split(","):
        by = {r["form"]: r for r in rows if r["model"] == model and "error" not in r}
        if set(FORMS) <= by.keys():
            for k in ("trace_s", "lower_s", "compile_s", "total_s", "stablehlo_bytes"):
                summary[f"{model}_{k}_scanned_over_unrolled"] = round(by["scanned"][k] / by["unrolled"][k], 3)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
