"""Parity of preheat's JAX FluxTransformer2DModel (and latent packing) with diffusers' torch original."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from preheat.errors import InvalidArgumentError, UnsupportedConfigError, WeightsError
from preheat.models.flux import (FluxTransformerConfig, build_abstract, build_flux_transformer, latent_image_ids,
                                 load_flux_transformer, pack_latents, rope_cos_sin, thousandfold, unpack_latents)
from preheat.models.weights import expected_torch_shape, torch_key

# Like diffusers' own FluxTransformer tests: tiny widths, one block of each kind.
TINY: dict[str, Any] = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                            axes_dims_rope=[4, 4, 8])
CASES = {
    "schnell-like": dict(TINY, guidance_embeds=False),
    "dev-like": dict(TINY, in_channels=4, guidance_embeds=True),
    "two-blocks-out8": dict(TINY, num_layers=2, num_single_layers=2, out_channels=8, guidance_embeds=True),
    # 3 + 4 blocks: both stages scanned over layer-stacked weights (preheat.models.stacking)
    "scanned-3-4": dict(TINY, num_layers=3, num_single_layers=4, guidance_embeds=True),
}

# The published FLUX.1 transformer/config.json files (diffusers keys, values as published).
_FLUX1 = dict(_class_name="FluxTransformer2DModel", _diffusers_version="0.30.0.dev0", attention_head_dim=128,
              in_channels=64, joint_attention_dim=4096, num_attention_heads=24, num_layers=19, num_single_layers=38,
              patch_size=1, pooled_projection_dim=768)
FLUX1_SCHNELL = dict(_FLUX1, guidance_embeds=False)
FLUX1_DEV = dict(_FLUX1, guidance_embeds=True, axes_dims_rope=[16, 56, 56])

LATENT_H, LATENT_W, TEXT_TOKENS, BATCH = 8, 10, 7, 2  # 4 x 5 = 20 image tokens (not square: catches transposes)


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, msg
    return msg


def _model_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def _save_tiny(folder: Path, config: dict[str, Any], seed: int = 0, **save_kwargs: Any) -> Path:
    """A random diffusers FluxTransformer2DModel with every weight moved off its init value (norm weights
    start at 1: a tensor mapped to the wrong place would otherwise go unnoticed)."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**_model_kwargs(config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, **save_kwargs)
    return folder


def _inputs(config: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Random inputs laid out as FluxPipeline makes them (packed latents, its ids, sigma = t / 1000)."""
    rng = np.random.RandomState(seed)
    c_in = config["in_channels"] // 4
    latents = rng.randn(BATCH, LATENT_H, LATENT_W, c_in).astype(np.float32)
    txt_ids = np.zeros((TEXT_TOKENS, 3), np.float32)
    txt_ids[:, 0] = np.arange(TEXT_TOKENS)  # nonzero text positions exercise the rotary path on text too
    return dict(
        hidden_states=np.asarray(pack_latents(jnp.asarray(latents))),
        encoder_hidden_states=rng.randn(BATCH, TEXT_TOKENS, config["joint_attention_dim"]).astype(np.float32),
        pooled_projections=rng.randn(BATCH, config["pooled_projection_dim"]).astype(np.float32),
        timestep=np.array([0.93, 0.25], np.float32),
        img_ids=latent_image_ids(LATENT_H, LATENT_W),
        txt_ids=txt_ids,
        guidance=np.array([3.5, 1.0], np.float32) if config.get("guidance_embeds") else None,
    )


def _reference(folder: Path, inputs: dict[str, Any]) -> np.ndarray:
    import torch
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(folder).eval()
    args = {k: None if v is None else torch.as_tensor(np.array(v)) for k, v in inputs.items()}
    with torch.no_grad():
        return model(**args, return_dict=False)[0].numpy()


def _as_bf16_reads(inputs: dict[str, Any]) -> dict[str, Any]:
    """The timestep and guidance as a bfloat16 FluxTransformer2DModel reads them: its
    ``timestep.to(dtype) * 1000`` rounds to bfloat16's grid (0.93 -> 928, not 930), an fp32 one does not."""
    import torch

    out = dict(inputs)
    for key in ("timestep", "guidance"):
        if inputs.get(key) is not None:
            out[key] = ((torch.as_tensor(np.array(inputs[key])).to(torch.bfloat16) * 1000).float() / 1000).numpy()
    return out


def _err(a: Any, b: Any) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    config = CASES[request.param]
    folder = _save_tiny(tmp_path_factory.mktemp(request.param), config)
    inputs = _inputs(config)
    return request.param, config, folder, inputs, _reference(folder, inputs)


# ----------------------------------------------------------------------------------------------
# Parity


def test_matches_diffusers_fp32(case):
    name, config, folder, inputs, ref = case
    model = load_flux_transformer(folder)
    out = jax.jit(model.apply)(model.params, **inputs)
    out_channels = config.get("out_channels") or config["in_channels"]
    assert out.shape == ref.shape == (BATCH, (LATENT_H // 2) * (LATENT_W // 2), out_channels)
    assert out.dtype == jnp.float32
    # The timestep/guidance sinusoids take sin/cos of float32 arguments up to 3500 rad, where torch's and
    # XLA's sin, cos and exp may each round differently (~1e-4 in the features, ~1e-5 at the output).
    scale = max(1.0, float(np.abs(ref).max()))
    assert _err(out, ref) <= 5e-5 * scale, f"{name}: max abs error {_err(out, ref):.3g} (output scale {scale:.3g})"


def test_every_input_matters(case):
    """Each input moves the output (a dropped or mis-wired input would pass a single parity check
    only by luck; this makes the parity test's coverage explicit)."""
    name, config, folder, inputs, ref = case
    model = load_flux_transformer(folder)
    forward = jax.jit(model.apply)
    base = np.asarray(forward(model.params, **inputs))
    changed = {
        "encoder_hidden_states": inputs["encoder_hidden_states"][:, ::-1],
        "pooled_projections": -inputs["pooled_projections"],
        "timestep": inputs["timestep"][::-1].copy(),
        "img_ids": inputs["img_ids"][::-1].copy(),
        "txt_ids": inputs["txt_ids"] + 5,
    }
    if config.get("guidance_embeds"):
        changed["guidance"] = inputs["guidance"] + 2.0
    for key, value in changed.items():
        assert _err(forward(model.params, **{**inputs, key: value}), base) > 1e-3, f"{name}: {key} has no effect"


def test_scalar_timestep_and_guidance_broadcast_over_the_batch(tmp_path):
    """A sampler may pass one sigma (and one guidance scale) for the whole batch, as diffusers' pipeline
    expands them."""
    config = CASES["dev-like"]
    model = load_flux_transformer(_save_tiny(tmp_path / "m", config, seed=4))
    inputs = _inputs(config)
    both = dict(inputs, timestep=np.full(BATCH, 0.6, np.float32), guidance=np.full(BATCH, 4.0, np.float32))
    scalar = dict(inputs, timestep=np.float32(0.6), guidance=np.float32(4.0))
    assert _err(model.apply(model.params, **scalar), model.apply(model.params, **both)) <= 1e-6


def test_bf16_runs_close_to_fp32_reference(case):
    """Against diffusers in fp32 fed what a bf16 model reads (its timestep and guidance on bf16's grid)."""
    name, config, folder, inputs, _ = case
    ref = _reference(folder, _as_bf16_reads(inputs))
    model = load_flux_transformer(folder, dtype=jnp.bfloat16)
    assert model.dtype == jnp.bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}
    out = jax.jit(model.apply)(model.params, **inputs)
    assert out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    # bf16 keeps 8 mantissa bits: over a few blocks the error stays a few percent of the output scale
    rel = _err(out, ref) / float(np.abs(ref).max())
    assert rel < 0.08, f"{name}: bf16 max error is {rel:.3f} of the output scale"


def test_rope_angles_match_diffusers_float64_at_full_resolution():
    """FluxPosEmbed computes its angles in float64; ours stay within float32 rounding of that
    even at large positions (a 2048-px image has 128 x 128 tokens)."""
    import torch
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    ids = np.concatenate([np.zeros((512, 3), np.float32), latent_image_ids(256, 256)])  # (512 + 16384, 3)
    ids[:512, 0] = np.arange(512)
    axes = (16, 56, 56)
    cos_ref, sin_ref = (t.numpy() for t in FluxPosEmbed(theta=10000, axes_dim=list(axes))(torch.as_tensor(ids)))
    cos, sin = jax.jit(rope_cos_sin, static_argnums=1)(jnp.asarray(ids), axes)
    assert cos.shape == cos_ref.shape == (ids.shape[0], 128)
    assert _err(cos, cos_ref) < 1e-6 and _err(sin, sin_ref) < 1e-6


def test_sharded_and_variant_folders_load_the_same_weights(tmp_path):
    config = CASES["dev-like"]
    plain = _save_tiny(tmp_path / "plain", config, seed=3)
    sharded = _save_tiny(tmp_path / "sharded", config, seed=3, max_shard_size="20KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert (sharded / "diffusion_pytorch_model.safetensors.index.json").is_file()
    a, b = load_flux_transformer(plain), load_flux_transformer(sharded)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    import torch
    from diffusers import FluxTransformer2DModel

    FluxTransformer2DModel.from_pretrained(plain).to(torch.bfloat16).save_pretrained(tmp_path / "plain", variant="bf16")
    c = load_flux_transformer(plain, variant="bf16")  # stored bf16, computed in float32
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(c.params)):
        assert y.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(x).astype(jnp.bfloat16).astype(np.float32), np.asarray(y))

    pipe = tmp_path / "pipe"
    shutil.copytree(plain, pipe / "transformer")
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert load_flux_transformer(pipe).config == a.config


def test_weights_are_data_one_compile_serves_two_checkpoints(tmp_path):
    config = CASES["schnell-like"]
    a = load_flux_transformer(_save_tiny(tmp_path / "a", config, seed=1))
    b = load_flux_transformer(_save_tiny(tmp_path / "b", config, seed=2))
    inputs = _inputs(config)
    forward = jax.jit(a.apply)
    out_a = forward(a.params, **inputs)
    out_b = forward(b.params, **{**inputs, "timestep": np.array([0.5, 0.1], np.float32)})
    assert forward._cache_size() == 1
    assert _err(out_a, out_b) > 1e-2


# ----------------------------------------------------------------------------------------------
# Latent packing: pure reshapes, so exact


@pytest.mark.parametrize("h,w,c", [(8, 10, 16), (4, 4, 4), (128, 96, 16)])
def test_pack_and_unpack_match_flux_pipeline_exactly(h, w, c):
    import torch
    from diffusers import FluxPipeline

    latents = torch.randn(2, c, h, w, generator=torch.Generator().manual_seed(h))  # NCHW, as diffusers holds them
    ref = FluxPipeline._pack_latents(latents, 2, c, h, w).numpy()
    nhwc = jnp.asarray(latents.numpy().transpose(0, 2, 3, 1))
    packed = np.asarray(pack_latents(nhwc))
    np.testing.assert_array_equal(packed, ref)

    tokens = torch.randn(2, (h // 2) * (w // 2), 4 * c, generator=torch.Generator().manual_seed(w))
    ref_unpacked = FluxPipeline._unpack_latents(tokens, h * 8, w * 8, 8).numpy()  # pixel size, vae_scale_factor 8
    ours = np.asarray(unpack_latents(jnp.asarray(tokens.numpy()), h, w)).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(ours, ref_unpacked)
    np.testing.assert_array_equal(np.asarray(unpack_latents(jnp.asarray(packed), h, w)), np.asarray(nhwc))

    ids = latent_image_ids(h, w)
    ref_ids = FluxPipeline._prepare_latent_image_ids(2, h // 2, w // 2, "cpu", torch.float32).numpy()
    assert ids.dtype == np.float32
    np.testing.assert_array_equal(ids, ref_ids)


def test_packing_refuses_odd_sizes_in_one_line():
    for call in (lambda: pack_latents(jnp.zeros((1, 7, 8, 16))), lambda: unpack_latents(jnp.zeros((1, 12, 64)), 7, 8),
                 lambda: latent_image_ids(8, 5)):
        with pytest.raises(InvalidArgumentError, match="must be even") as info:
            call()
        _one_line(info.value)
    with pytest.raises(InvalidArgumentError, match="cannot be a 8x8 latent") as info:
        unpack_latents(jnp.zeros((1, 12, 64)), 8, 8)
    _one_line(info.value)


# ----------------------------------------------------------------------------------------------
# Published configs at full size, by shape (no weights, no memory)


@pytest.mark.parametrize("name,config", [("flux1-schnell", FLUX1_SCHNELL), ("flux1-dev", FLUX1_DEV)])
def test_published_configs_map_every_tensor_both_ways(name, config):
    import torch
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**_model_kwargs(config))
    ref = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    parsed = FluxTransformerConfig.from_dict(config)
    assert parsed.guidance_embeds is config["guidance_embeds"] and parsed.axes_dims_rope == (16, 56, 56)
    _, abstract = build_abstract(parsed)
    ours = {torch_key(path): expected_torch_shape(tuple(var.shape), str(path[-1]))
            for path, var in nnx.to_flat_state(abstract)}
    assert sorted(set(ref) - set(ours)) == [], f"{name}: keys diffusers has and preheat lacks"
    assert sorted(set(ours) - set(ref)) == [], f"{name}: keys preheat has and diffusers lacks"
    wrong = {k: (ours[k], ref[k]) for k in ref if ours[k] != ref[k]}
    assert wrong == {}, f"{name}: mis-shaped"
    n_params = sum(int(np.prod(s)) for s in ref.values())
    assert n_params > 11.8e9, n_params  # the whole 12B model, not a fragment
    assert any(k.startswith("time_text_embed.guidance_embedder.") for k in ours) is config["guidance_embeds"]


@pytest.mark.slow
def test_full_width_dev_blocks_match_diffusers():
    """FLUX.1-dev's real widths (24 heads of 128, rotary axes 16/56/56, T5 4096, CLIP 768, 64 packed
    channels) with one block of each kind: 0.5B random fp32 parameters, about 4 GB at peak."""
    import torch
    from diffusers import FluxTransformer2DModel

    config = dict(FLUX1_DEV, num_layers=1, num_single_layers=1)
    torch.manual_seed(0)
    model = FluxTransformer2DModel(**_model_kwargs(config)).eval()
    with torch.no_grad():  # move RMSNorm weights and zero-initialised biases off 1 / 0
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.05)
    tensors = {k: v.numpy() for k, v in model.state_dict().items()}  # shares torch's memory
    ours = build_flux_transformer(FluxTransformerConfig.from_dict(config), tensors)
    del tensors
    inputs = _inputs(config, seed=5)
    args = {k: None if v is None else torch.as_tensor(np.array(v)) for k, v in inputs.items()}
    with torch.no_grad():
        ref = model(**args, return_dict=False)[0].numpy()
    del model
    out = jax.jit(ours.apply)(ours.params, **inputs)
    scale = max(1.0, float(np.abs(ref).max()))
    assert _err(out, ref) <= 5e-5 * scale, f"max abs error {_err(out, ref):.3g} (output scale {scale:.3g})"


# ----------------------------------------------------------------------------------------------
# Bad input: one line, naming the problem


@pytest.mark.parametrize("override,needle", [
    ({"patch_size": 2}, "patch_size 2"),
    ({"_class_name": "Flux2Transformer2DModel"}, "'Flux2Transformer2DModel'"),
    ({"axes_dims_rope": [4, 4, 4]}, "sums to 12, but attention_head_dim is 16"),
    ({"axes_dims_rope": [4, 5, 7]}, "axes_dims_rope must be positive even integers"),
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1"),
    ({"guidance_embeds": "yes"}, "guidance_embeds must be true or false"),
    ({"some_future_option": 1}, "some_future_option"),
])
def test_unsupported_config_is_refused_by_name(override, needle):
    with pytest.raises(UnsupportedConfigError) as info:
        FluxTransformerConfig.from_dict({"_class_name": "FluxTransformer2DModel", **TINY, **override})
    msg = _one_line(info.value)
    assert needle in msg, msg


def test_config_round_trips_and_architecture_dict_is_the_config():
    config = FluxTransformerConfig.from_dict(FLUX1_DEV)
    assert FluxTransformerConfig.from_dict(config.to_dict()) == config
    arch = config.architecture_dict()
    assert arch["guidance_embeds"] is True and arch["axes_dims_rope"] == [16, 56, 56]
    assert json.loads(json.dumps(arch)) == arch
    assert arch != FluxTransformerConfig.from_dict(FLUX1_SCHNELL).architecture_dict()


def test_mismatched_weights_are_one_line(case, tmp_path):
    name, config, folder, inputs, ref = case
    bare = shutil.copytree(folder, tmp_path / "bare")
    raw = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**raw, "guidance_embeds": not raw["guidance_embeds"]}))
    with pytest.raises(WeightsError, match="time_text_embed.guidance_embedder.linear_1.weight") as info:
        load_flux_transformer(bare)
    _one_line(info.value)


def test_guidance_and_mis_shaped_inputs_are_one_line(case):
    name, config, folder, inputs, ref = case
    model = load_flux_transformer(folder)
    guided = config["guidance_embeds"]
    cases = [
        ({"guidance": None if guided else np.ones(2, np.float32)}, "pass guidance" if guided else "guidance=None"),
        ({"hidden_states": inputs["hidden_states"][..., :3]}, "hidden_states must be"),
        ({"encoder_hidden_states": inputs["encoder_hidden_states"][:1]}, "encoder_hidden_states must be (2, T, 32)"),
        ({"pooled_projections": inputs["pooled_projections"][:, :8]}, "pooled_projections must be (2, 32)"),
        ({"img_ids": inputs["img_ids"][:5]}, "img_ids must be (20, 3)"),
        ({"txt_ids": inputs["txt_ids"][None]}, "txt_ids must be (7, 3)"),
        ({"timestep": np.zeros(3, np.float32)}, "timestep must be a scalar or (2,)"),
    ]
    for override, needle in cases:
        with pytest.raises(InvalidArgumentError) as info:
            model.apply(model.params, **{**inputs, **override})
        msg = _one_line(info.value)
        assert needle in msg, f"{name}: {msg}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_timestep_and_guidance_are_scaled_as_torch_scales_them(dtype):
    """``v.to(dtype) * 1000`` in torch, compiled by XLA: its excess precision kept 3.5 x 1000 at 3500 in
    a bfloat16 program on a CPU, where torch (and XLA:TPU) give 3504, and the guidance sinusoids moved."""
    torch = pytest.importorskip("torch")
    values = np.concatenate([[3.5, 1.0, 0.75, 0.5, 4.0, 1e-3], np.random.default_rng(0).uniform(0, 10, 200)])
    want = (torch.tensor(values, dtype=torch.float32).to(getattr(torch, dtype)) * 1000).float().numpy()
    got = np.asarray(jax.jit(lambda v: thousandfold(v, jnp.dtype(dtype)))(jnp.asarray(values, jnp.float32)))
    np.testing.assert_array_equal(got, want)
    if dtype == "bfloat16":
        assert got[0] == 3504.0
