"""Parity of preheat's JAX SD3Transformer2DModel with diffusers' torch SD3Transformer2DModel (the reference)."""

from __future__ import annotations

import json
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from preheat.errors import InvalidArgumentError, ModelNotFoundError, UnsupportedConfigError, WeightsError
from preheat.models.sd3 import (SD3TransformerConfig, build_abstract, checkpoint_key, load_sd3_transformer,
                                sincos_pos_embed_2d)
from preheat.models.weights import expected_torch_shape, to_torch_layout

# fp32 parity bound, relative to the output's magnitude: measured max abs error ~1e-5 on outputs ~3
# (both sides take their own float32 paths through ~30 matmuls and softmaxes).
FP32_TOL = 2e-5

# Like diffusers' own SD3 pipeline tests (sample_size 32, 4 heads of 8, 32-wide text), one case per option.
TINY: dict[str, Any] = dict(sample_size=32, attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                            joint_attention_dim=32, pooled_projection_dim=64)
CASES: dict[str, dict[str, Any]] = {
    # SD3-medium's shape: patch 2, cropped position table, no q/k norm.
    "sd3": dict(patch_size=2, in_channels=4, out_channels=4, num_layers=2, pos_embed_max_size=64),
    # SD3.5's RMS q/k norms; no stored table (computed per latent grid); patch 1, 16 channels, one block.
    "rms-no-max": dict(patch_size=1, in_channels=16, out_channels=16, num_layers=1, pos_embed_max_size=None,
                       qk_norm="rms_norm"),
    # SD3.5-medium's shape: dual attention, here also in the last (context_pre_only) block.
    "sd35-medium": dict(patch_size=2, in_channels=16, out_channels=16, num_layers=2, pos_embed_max_size=64,
                        qk_norm="rms_norm", dual_attention_layers=[0, 1]),
    # runs of like blocks scanned over layer-stacked weights (preheat.models.stacking): 3 dual, 3 plain, the last
    "sd35-scanned": dict(patch_size=2, in_channels=16, out_channels=16, num_layers=7, pos_embed_max_size=64,
                         qk_norm="rms_norm", dual_attention_layers=[0, 1, 2]),
}
# Latent (h, w) per case: never square, so rows and columns cannot be swapped unnoticed; the patch
# grids (5x7, 6x10, 9x5) are off-centre in the 64x64 table (odd margins).
LATENT = {"sd3": (10, 14), "rms-no-max": (6, 10), "sd35-medium": (18, 10), "sd35-scanned": (10, 14)}

# Published transformer/config.json of each model (everything else at diffusers' defaults).
SD3_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                  num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192)
SD35_LARGE = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                  num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm")
SD35_MEDIUM = dict(SD3_MEDIUM, pos_embed_max_size=384, qk_norm="rms_norm", dual_attention_layers=list(range(13)))


def tiny_config(case: str, **overrides: Any) -> dict[str, Any]:
    return {**TINY, **CASES[case], **overrides}


def _torch_model(config: dict[str, Any], seed: int = 0, matrices: bool = True):
    """A random model, every parameter moved off torch's initialisation (zero biases, unit norm
    weights would hide errors behind them). ``matrices=False`` moves only the vectors: at full
    width, noise on every matrix would blow activations up by ~4x per layer."""
    import torch
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if matrices or p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """case -> (folder, torch model), built once per module."""
    built = {}

    def get(case: str):
        if case not in built:
            model = _torch_model(tiny_config(case))
            path = tmp_path_factory.mktemp(case)
            model.save_pretrained(path)
            built[case] = (path, model)
        return built[case]

    return get


def tiny_inputs(config: dict[str, Any], batch: int = 2, height: int = 8, width: int = 8, tokens: int = 7,
                seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {
        "hidden_states": g.standard_normal((batch, config["in_channels"], height, width)).astype(np.float32),
        "encoder_hidden_states": g.standard_normal((batch, tokens, config["joint_attention_dim"])).astype(np.float32),
        "pooled_projections": g.standard_normal((batch, config["pooled_projection_dim"])).astype(np.float32),
        "timestep": np.linspace(999.0, 3.5, batch).astype(np.float32),  # flow-matching t * 1000, one per sample
    }


def torch_output(model, inputs: dict[str, np.ndarray]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(**{k: torch.from_numpy(v) for k, v in inputs.items()}).sample.numpy()


def jax_output(transformer, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Through the pure NHWC ``apply`` under jit (diffusers' NCHW transposed at the edges)."""
    x = jnp.transpose(jnp.asarray(inputs["hidden_states"]), (0, 2, 3, 1))
    out = jax.jit(transformer.apply)(transformer.params, x, inputs["encoder_hidden_states"],
                                     inputs["pooled_projections"], inputs["timestep"])
    return np.transpose(np.asarray(out, np.float32), (0, 3, 1, 2))


def _max_err(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("case", list(CASES))
def test_matches_diffusers_fp32(tiny, case):
    path, model = tiny(case)
    transformer = load_sd3_transformer(path)
    h, w = LATENT[case]
    inputs = tiny_inputs(tiny_config(case), batch=2, height=h, width=w, seed=1)
    ref = torch_output(model, inputs)
    out = jax_output(transformer, inputs)
    assert out.shape == (2, CASES[case]["out_channels"], h, w)
    scale = max(1.0, float(np.abs(ref).max()))
    err = _max_err(out, ref)
    assert err <= FP32_TOL * scale, f"{case}: max abs error {err:.3g} on outputs up to {scale:.3g}"
    assert np.abs(ref).max() > 0.5  # a real signal, not a near-zero output that any bug would match
    assert _max_err(out[0], out[1]) > 0.1  # the two samples (and their timesteps) really differ


def test_nchw_call_and_scalar_timestep(tiny):
    """``__call__`` takes diffusers' NCHW arguments; a 0-d timestep is broadcast over the batch."""
    path, model = tiny("sd3")
    transformer = load_sd3_transformer(path)
    inputs = tiny_inputs(tiny_config("sd3"), batch=2, height=4, width=6, seed=2)
    inputs["timestep"] = np.asarray(500.0, np.float32)
    ref = torch_output(model, {**inputs, "timestep": np.full((2,), 500.0, np.float32)})
    out = np.asarray(transformer(**inputs))
    assert _max_err(out, ref) <= FP32_TOL * max(1.0, float(np.abs(ref).max()))


def test_skip_layers_matches_diffusers(tiny):
    """Skip-layer guidance (SD3.5): diffusers' ``skip_layers`` leaves blocks out (the first, with dual attention)."""
    import torch

    path, model = tiny("sd35-medium")
    transformer = load_sd3_transformer(path)
    inputs = tiny_inputs(tiny_config("sd35-medium"), height=8, width=6, seed=6)
    with torch.no_grad():
        ref = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}, skip_layers=[0]).sample.numpy()
    out = np.asarray(transformer(**inputs, skip_layers=(0,)))
    assert _max_err(out, ref) <= FP32_TOL * max(1.0, float(np.abs(ref).max()))
    assert _max_err(out, torch_output(model, inputs)) > 0.1  # skipping a block really changes the output
    with pytest.raises(InvalidArgumentError, match=r"skip_layers \[2\] out of range") as info:
        transformer(**inputs, skip_layers=(2,))
    _one_line(info.value)


def test_skip_layers_inside_scanned_runs_match_diffusers(tiny):
    """Skipped blocks inside both scanned runs (a ``lax.cond`` per iteration) and the unscanned last one."""
    import torch

    from preheat.models.stacking import BlockStack

    path, model = tiny("sd35-scanned")
    transformer = load_sd3_transformer(path)
    stacks = [m for _, m in nnx.iter_graph(nnx.merge(transformer.graphdef, transformer.params))
              if isinstance(m, BlockStack)]
    assert [s.n for s in stacks] == [3, 3]
    inputs = tiny_inputs(tiny_config("sd35-scanned"), height=8, width=6, seed=6)
    for skip in ((1, 4), (0, 6)):
        with torch.no_grad():
            ref = model(**{k: torch.from_numpy(v) for k, v in inputs.items()}, skip_layers=list(skip)).sample.numpy()
        out = np.asarray(transformer(**inputs, skip_layers=skip))
        assert _max_err(out, ref) <= FP32_TOL * max(1.0, float(np.abs(ref).max())), skip


def test_position_table_matches_diffusers():
    """The host-side sin-cos table (non-square grids, both base sizes) and the static centre crop
    against diffusers' ``get_2d_sincos_pos_embed`` and ``PatchEmbed.cropped_pos_embed``."""
    from diffusers.models.embeddings import PatchEmbed, get_2d_sincos_pos_embed

    for dim, grid, base in [(32, (6, 10), 32), (32, (10, 6), 16), (48, (3, 3), 16), (16, (1, 7), 8)]:
        ref = get_2d_sincos_pos_embed(dim, grid, base_size=base, output_type="pt").float().numpy()
        np.testing.assert_allclose(sincos_pos_embed_2d(dim, grid, base), ref, rtol=0, atol=1e-6,
                                   err_msg=f"{dim} {grid} {base}")

    torch_embed = PatchEmbed(height=32, width=32, patch_size=2, in_channels=4, embed_dim=32, pos_embed_max_size=12)
    ours = load_like(torch_embed)
    for h, w in [(5, 7), (12, 12), (1, 12), (4, 9)]:
        ref = torch_embed.cropped_pos_embed(2 * h, 2 * w).numpy()
        np.testing.assert_array_equal(np.asarray(ours.position_embedding(h, w)), ref, err_msg=f"{h}x{w}")


def load_like(torch_embed):
    """Our PatchEmbed filled from a torch PatchEmbed's state dict."""
    from preheat.models.sd3 import PatchEmbed
    from preheat.models.weights import fill

    config = SD3TransformerConfig.from_dict(dict(TINY, patch_size=2, in_channels=4, pos_embed_max_size=12))
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: PatchEmbed(config, rngs=nnx.Rngs(0))))
    tensors = {k: v.numpy() for k, v in torch_embed.state_dict().items()}
    params = fill(abstract, tensors, jnp.float32, "patch embed", key_fn=checkpoint_key)
    return nnx.merge(graphdef, params)


def test_one_program_for_every_timestep_and_prompt(tiny):
    """Under jit, timestep, text, pooled text and latent are data: new values never retrace."""
    path, model = tiny("sd35-medium")
    transformer = load_sd3_transformer(path)
    traces = []

    @jax.jit
    def f(params, x, ctx, pooled, t):
        traces.append(1)
        return transformer.apply(params, x, ctx, pooled, t)

    for seed in (3, 4):
        inputs = tiny_inputs(tiny_config("sd35-medium"), height=8, width=8, seed=seed)
        inputs["timestep"] = inputs["timestep"] * (seed / 7)
        x = jnp.transpose(inputs["hidden_states"], (0, 2, 3, 1))
        out = f(transformer.params, x, inputs["encoder_hidden_states"], inputs["pooled_projections"],
                inputs["timestep"])
        ref = torch_output(model, inputs)
        assert _max_err(np.transpose(np.asarray(out), (0, 3, 1, 2)), ref) <= FP32_TOL * max(1.0, np.abs(ref).max())
    assert len(traces) == 1


def test_bf16_runs_close_to_fp32_reference(tiny):
    """bf16 weights and activations against diffusers in fp32. Measured max abs error 2e-2 to 5e-2 on outputs ~3."""
    path, model = tiny("sd35-medium")
    transformer = load_sd3_transformer(path, dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(transformer.params)} == {jnp.dtype(jnp.bfloat16)}
    inputs = tiny_inputs(tiny_config("sd35-medium"), height=8, width=12, seed=5)
    x = jnp.transpose(jnp.asarray(inputs["hidden_states"]), (0, 2, 3, 1))
    out = jax.jit(transformer.apply)(transformer.params, x, inputs["encoder_hidden_states"],
                                     inputs["pooled_projections"], inputs["timestep"])
    assert out.dtype == jnp.bfloat16
    out = np.transpose(np.asarray(out, np.float32), (0, 3, 1, 2))
    ref = torch_output(model, inputs)
    assert np.isfinite(out).all()
    err = _max_err(out, ref)
    assert err <= 0.05 * max(1.0, float(np.abs(ref).max())), err


def _torch_layout_params(transformer) -> dict[str, np.ndarray]:
    return {checkpoint_key(path): to_torch_layout(np.asarray(var.get_value()), str(path[-1]))
            for path, var in nnx.to_flat_state(transformer.params)}


def test_sharded_fp16_variant_loads_every_tensor(tmp_path):
    """A sharded fp16 variant (index + shards, as published SD3.5 folders are) reads every tensor as
    diffusers' own load of the same folder does (exact: a cast and a transpose)."""
    import torch
    from diffusers import SD3Transformer2DModel

    model = _torch_model(tiny_config("sd35-medium"), seed=3).to(torch.float16)
    model.save_pretrained(tmp_path, variant="fp16", max_shard_size="100KB")
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.fp16.json").is_file()  # diffusers' variant index name
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    with pytest.raises(ModelNotFoundError, match="has no diffusion_pytorch_model.safetensors") as info:
        load_sd3_transformer(tmp_path)
    _one_line(info.value)
    transformer = load_sd3_transformer(tmp_path, variant="fp16")
    ref = {k: v.float().numpy() for k, v in
           SD3Transformer2DModel.from_pretrained(tmp_path, variant="fp16").state_dict().items()}
    ours = _torch_layout_params(transformer)
    assert sorted(ours) == sorted(ref)
    for key, value in ref.items():
        assert ours[key].dtype == np.float32
        np.testing.assert_array_equal(ours[key], value, err_msg=key)


# ----------------------------------------------------------------------------------------------
# Published configs at full size, by shape (no weights, no memory)


@pytest.mark.parametrize("name,config", [("sd3-medium", SD3_MEDIUM), ("sd3.5-large", SD35_LARGE),
                                         ("sd3.5-medium", SD35_MEDIUM)])
def test_published_configs_map_every_tensor_both_ways(name, config):
    import torch
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        model = SD3Transformer2DModel(**config)
    ref = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    _, abstract = build_abstract(SD3TransformerConfig.from_dict({"_class_name": "SD3Transformer2DModel", **config}))
    ours = {checkpoint_key(path): expected_torch_shape(tuple(var.shape), str(path[-1]))
            for path, var in nnx.to_flat_state(abstract)}
    assert sorted(set(ref) - set(ours)) == [], f"{name}: keys diffusers has and preheat lacks"
    assert sorted(set(ours) - set(ref)) == [], f"{name}: keys preheat has and diffusers lacks"
    wrong = {k: (ours[k], ref[k]) for k in ref if ours[k] != ref[k]}
    assert wrong == {}, f"{name}: mis-shaped"
    assert "pos_embed.pos_embed" in ref and len(ref) > 24 * 20  # the whole model, the position table included


@pytest.mark.slow
def test_full_width_sd35_medium_blocks_match_diffusers():
    """SD3.5-medium's real widths (24 heads of 64, 4096-wide T5 states, RMS q/k norms) in two blocks,
    the first with dual attention, the 192 x 192 position table; random fp32 weights, a 32x40 latent,
    77 text tokens. Measured: max abs error 2e-6 on outputs ~3; peak memory 2.3 GB, ~40 s."""
    from preheat.models.sd3 import build_sd3_transformer

    config = dict(SD35_MEDIUM, num_layers=2, dual_attention_layers=[0], pos_embed_max_size=192)
    model = _torch_model(config, seed=11, matrices=False)
    tensors = {k: v.numpy() for k, v in model.state_dict().items()}  # shares torch's memory
    transformer = build_sd3_transformer(SD3TransformerConfig.from_dict(config), tensors)
    del tensors
    inputs = tiny_inputs(config, batch=2, height=32, width=40, tokens=77, seed=12)
    ref = torch_output(model, inputs)
    del model
    out = jax_output(transformer, inputs)
    scale = max(1.0, float(np.abs(ref).max()))
    err = _max_err(out, ref)
    assert err <= FP32_TOL * scale, f"max abs error {err:.3g} on outputs up to {scale:.3g}"
    assert np.abs(ref).max() > 0.5


# ----------------------------------------------------------------------------------------------
# Bad input: one line, naming the problem


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("override,needle", [
    ({"qk_norm": "layer_norm"}, "qk_norm 'layer_norm' in config.json; supported: None, 'rms_norm'"),
    ({"_class_name": "FluxTransformer2DModel"}, "supported: 'SD3Transformer2DModel'"),
    ({"some_future_option": 1}, "some_future_option"),
    ({"caption_projection_dim": 48}, "caption_projection_dim 48 must equal"),
    ({"num_layers": 0}, "num_layers must be a positive integer"),
    ({"pos_embed_max_size": -1}, "pos_embed_max_size must be a positive integer"),
    ({"dual_attention_layers": "all"}, "dual_attention_layers must be a list"),
    ({"attention_head_dim": 6, "caption_projection_dim": 6 * 3, "num_attention_heads": 3}, "divisible by 4"),
])
def test_unsupported_config_is_refused_by_name(override, needle):
    raw = {"_class_name": "SD3Transformer2DModel", **tiny_config("sd3"), **override}
    with pytest.raises(UnsupportedConfigError) as info:
        SD3TransformerConfig.from_dict(raw)
    msg = _one_line(info.value)
    assert needle in msg, msg


def test_folder_problems_are_one_line(tiny, tmp_path):
    path, _ = tiny("sd3")
    with pytest.raises(ModelNotFoundError) as info:
        load_sd3_transformer(tmp_path / "nowhere")
    _one_line(info.value)
    bare = shutil.copytree(path, tmp_path / "bare")
    raw = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**raw, "joint_attention_dim": 48}))
    needle = r"context_embedder.weight has shape \(32, 32\), expected \(32, 48\)"
    with pytest.raises(WeightsError, match=needle) as info:
        load_sd3_transformer(bare)
    _one_line(info.value)
    (bare / "config.json").write_text(json.dumps({**raw, "qk_norm": "rms_norm"}))
    with pytest.raises(WeightsError, match="missing transformer_blocks.0.attn.norm_q.weight") as info:
        load_sd3_transformer(bare)
    _one_line(info.value)


def test_pipeline_folder_loads_its_transformer(tiny, tmp_path):
    path, _ = tiny("sd3")
    shutil.copytree(path, tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps(
        {"_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"]}))
    a, b = load_sd3_transformer(tmp_path / "pipe"), load_sd3_transformer(path)
    assert a.config == b.config
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_mis_shaped_inputs_are_one_line(tiny):
    path, _ = tiny("sd3")
    transformer = load_sd3_transformer(path)
    good = tiny_inputs(tiny_config("sd3"), batch=2, height=4, width=4)
    x, ctx, pooled, t = (good[k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"))
    cases = [
        ((x[:, :3], ctx, pooled, t), "latent must be (B, h, w, 4) NHWC"),
        ((x[0], ctx, pooled, t), "hidden_states must be (B, C, H, W)"),
        ((x[..., :3], ctx, pooled, t), "multiples of patch_size 2, got 4x3"),
        ((np.zeros((2, 4, 130, 2), np.float32), ctx, pooled, t), "65x1 patches, more than pos_embed_max_size 64"),
        ((x, ctx[..., :16], pooled, t), "encoder_hidden_states must be (2, T, 32)"),
        ((x, ctx, pooled[:1], t), "pooled_projections must be (2, 64)"),
        ((x, ctx, pooled, np.zeros(3, np.float32)), "timestep must be a scalar or (2,)"),
    ]
    for args, needle in cases:
        with pytest.raises(InvalidArgumentError) as info:
            transformer(*args)
        msg = _one_line(info.value)
        assert needle in msg, msg


def test_architecture_dict_tracks_the_program():
    a = SD3TransformerConfig.from_dict(tiny_config("sd3"))
    b = SD3TransformerConfig.from_dict(tiny_config("sd3", qk_norm="rms_norm"))
    c = SD3TransformerConfig.from_dict({**tiny_config("sd3"), "_class_name": "SD3Transformer2DModel",
                                        "_diffusers_version": "0.42.1"})
    assert a.architecture_dict() != b.architecture_dict()
    assert a.architecture_dict() == c.architecture_dict()
    assert SD3TransformerConfig.from_dict(tiny_config("sd3", out_channels=None)).out_dim == 4
    json.dumps(a.architecture_dict())  # a cache key must serialise
