"""Parity of preheat's JAX UNet2DConditionModel with diffusers' torch UNet2DConditionModel (the reference)."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from preheat.errors import InvalidArgumentError, ModelFormatError, PreheatError, UnsupportedConfigError, WeightsError
from preheat.models.unet2d_condition import (UNet2DConditionConfig, build_abstract, build_unet_condition,
                                             check_text_conditioning, load_unet_condition)
from preheat.models.weights import expected_torch_shape, torch_key
from tests._support.unet_condition_fixtures import (SD15_UNET, SD21_UNET, SDXL_BASE_UNET, TINY_POOLED_WIDTH, jax_output,
                                                  save_tiny_unet_condition, tiny_config, tiny_inputs, torch_output)

FP32_TOL = 1e-4


def _torch_model(path):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(kind, overrides) -> (folder, torch model), built once per module."""
    built = {}

    def get(kind, **overrides):
        key = (kind, json.dumps(overrides, sort_keys=True))
        if key not in built:
            path = save_tiny_unet_condition(tmp_path_factory.mktemp(kind), kind, **overrides)
            built[key] = (path, _torch_model(path))
        return built[key]

    return get


def _max_err(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


# (id, kind, config overrides): the three families, then every other supported option once.
CASES = [
    ("sd1", "sd1", {}),  # conv projection, attention_head_dim an int
    ("sd2", "sd2", {}),  # linear projection, attention_head_dim a list, upcast attention
    ("sdxl", "sdxl", {}),  # DownBlock2D first, text_time, transformer_layers_per_block [1, 2]
    ("sd1-options", "sd1", dict(center_input_sample=True, downsample_padding=0, freq_shift=1, flip_sin_to_cos=False,
                                time_embedding_dim=96, norm_eps=1e-6, layers_per_block=[1, 2],
                                mid_block_scale_factor=1.41421356)),
    ("sd2-no-mid", "sd2", dict(mid_block_type=None, act_fn="swish", upcast_attention=False,
                               transformer_layers_per_block=2)),
    # three blocks per transformer: scanned over layer-stacked weights (preheat.models.stacking)
    ("sdxl-scanned", "sdxl", dict(transformer_layers_per_block=[1, 3])),
]


@pytest.mark.parametrize("name,kind,overrides", CASES, ids=[c[0] for c in CASES])
def test_matches_diffusers_fp32(tiny, name, kind, overrides):
    path, model = tiny(kind, **overrides)
    unet = load_unet_condition(path)
    config = tiny_config(kind, **overrides)
    inputs = tiny_inputs(config, batch=2, seed=0)
    ref = torch_output(model, inputs)
    err = _max_err(jax_output(unet, inputs, jit=False), ref)
    assert err <= FP32_TOL, f"{name}: max abs error {err:.3g} > {FP32_TOL}"
    assert np.abs(ref).max() > 0.5  # a real signal, not a near-zero output that any bug would match


def test_non_square_odd_latent(tiny):
    """9x14: rows and columns kept apart, and an odd side, where diffusers upsamples to the skip's size
    (``upsample_size``) instead of x2. Batch 1 with a scalar (0-d) timestep, broadcast as diffusers does."""
    path, model = tiny("sd1")
    unet = load_unet_condition(path)
    inputs = tiny_inputs(tiny_config("sd1"), batch=1, height=9, width=14, seed=3)
    inputs["timestep"] = np.asarray(417, np.int64)
    ref = torch_output(model, inputs)
    assert ref.shape == (1, 4, 9, 14)
    err = _max_err(jax_output(unet, inputs, jit=False), ref)
    assert err <= FP32_TOL, f"max abs error {err:.3g}"


@pytest.mark.parametrize("n_in,n_out", [(5, 9), (3, 5), (7, 13), (33, 65), (50, 99), (4, 8), (6, 6)])
def test_nearest_resize_picks_torchs_rows(n_in, n_out):
    """Upsample2D to an explicit size takes the rows torch's ``interpolate(mode="nearest")`` takes."""
    import torch

    from preheat.models.layers import nearest_index

    rows = torch.arange(n_in, dtype=torch.float32).reshape(1, 1, n_in, 1)
    ref = torch.nn.functional.interpolate(rows, size=(n_out, 1), mode="nearest").reshape(-1).numpy()
    np.testing.assert_array_equal(nearest_index(n_in, n_out), ref.astype(np.int32))


def test_num_attention_heads_wins_over_attention_head_dim(tiny, tmp_path):
    """diffusers resolves heads as ``num_attention_heads or attention_head_dim``.

    diffusers itself refuses a non-null ``num_attention_heads`` today, so the reference is the same
    weights with the heads given the usual way (``attention_head_dim``).
    """
    path, model = tiny("sdxl")
    renamed = shutil.copytree(path, tmp_path / "renamed")
    raw = json.loads((renamed / "config.json").read_text())
    raw["num_attention_heads"], raw["attention_head_dim"] = raw["attention_head_dim"], [16, 16]
    (renamed / "config.json").write_text(json.dumps(raw))
    unet = load_unet_condition(renamed)
    assert unet.config.heads == (2, 4)
    inputs = tiny_inputs(tiny_config("sdxl"), seed=4)
    assert _max_err(jax_output(unet, inputs, jit=False), torch_output(model, inputs)) <= FP32_TOL


def test_one_program_serves_two_weight_sets(tiny, tmp_path):
    """Under jit, the weights are an argument: one trace, each weight set matches its own reference."""
    path_a, model_a = tiny("sd1")
    path_b = save_tiny_unet_condition(tmp_path / "b", "sd1", seed=7)
    a, b = load_unet_condition(path_a), load_unet_condition(path_b)
    traces = []

    @jax.jit
    def f(params, x, t, context):
        traces.append(1)
        return a.apply(params, x, t, context)

    inputs = tiny_inputs(tiny_config("sd1"), seed=5)
    x = jnp.transpose(inputs["sample"], (0, 2, 3, 1))
    t, ctx = inputs["timestep"], inputs["encoder_hidden_states"]
    out_a = np.transpose(np.asarray(f(a.params, x, t, ctx)), (0, 3, 1, 2))
    out_b = np.transpose(np.asarray(f(b.params, x, t, ctx)), (0, 3, 1, 2))
    assert len(traces) == 1
    assert _max_err(out_a, torch_output(model_a, inputs)) <= FP32_TOL
    assert _max_err(out_b, torch_output(_torch_model(path_b), inputs)) <= FP32_TOL
    assert _max_err(out_a, out_b) > 0.1


def test_bf16_runs_close_to_fp32_reference(tiny):
    """bf16 weights and activations (SD 2.x: attention upcast to float32), against diffusers in fp32.

    Measured max abs error ~2e-2 on outputs ~2."""
    kind = "sd2"
    path, model = tiny(kind)
    unet = load_unet_condition(path, dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(unet.params)} == {jnp.dtype(jnp.bfloat16)}
    inputs = tiny_inputs(tiny_config(kind), seed=6)
    ref = torch_output(model, inputs)
    out = jax_output(unet, inputs, jit=False)
    assert np.isfinite(out).all()
    err = _max_err(out, ref)
    assert err <= 0.1 * max(1.0, float(np.abs(ref).max())), err


def _torch_layout_params(unet) -> dict[str, np.ndarray]:
    from preheat.models.weights import to_torch_layout

    return {torch_key(path): to_torch_layout(np.asarray(var.get_value()), str(path[-1]))
            for path, var in nnx.to_flat_state(unet.params)}


def test_fp16_variant_and_sharded_weights(tmp_path):
    """``variant="fp16"`` reads ``*.fp16.safetensors``; a sharded checkpoint (index + shards) reads the same.

    Every tensor is compared with diffusers' own load of the same folder (exact: a cast and a transpose).
    """
    from diffusers import UNet2DConditionModel

    path = save_tiny_unet_condition(tmp_path / "fp16", "sdxl", variant="fp16")
    assert (path / "diffusion_pytorch_model.fp16.safetensors").is_file()
    with pytest.raises(PreheatError, match="fp16") as info:
        load_unet_condition(path)  # no plain file: the error names the variant file it found instead
    _one_line(info.value)
    unet = load_unet_condition(path, variant="fp16")
    model = UNet2DConditionModel.from_pretrained(path, variant="fp16")
    ref = {k: v.float().numpy() for k, v in model.state_dict().items()}
    ours = _torch_layout_params(unet)
    assert sorted(ours) == sorted(ref)
    for key, value in ref.items():
        assert ours[key].dtype == np.float32
        np.testing.assert_array_equal(ours[key], value, err_msg=key)

    model.float().save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    sharded = _torch_layout_params(load_unet_condition(tmp_path / "sharded"))
    for key, value in ref.items():
        np.testing.assert_array_equal(sharded[key], value, err_msg=key)


# ----------------------------------------------------------------------------------------------
# Published configs at full size, by shape (no weights, no memory)


@pytest.mark.parametrize("name,config", [("sd15", SD15_UNET), ("sd21-768v", SD21_UNET), ("sdxl-base", SDXL_BASE_UNET)])
def test_published_configs_map_every_tensor_both_ways(name, config):
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        model = UNet2DConditionModel(**config)
    ref = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    _, abstract = build_abstract(UNet2DConditionConfig.from_dict(config))
    ours = {torch_key(path): expected_torch_shape(tuple(var.shape), str(path[-1]))
            for path, var in nnx.to_flat_state(abstract)}
    assert sorted(set(ref) - set(ours)) == [], f"{name}: keys diffusers has and preheat lacks"
    assert sorted(set(ours) - set(ref)) == [], f"{name}: keys preheat has and diffusers lacks"
    wrong = {k: (ours[k], ref[k]) for k in ref if ours[k] != ref[k]}
    assert wrong == {}, f"{name}: mis-shaped"
    assert len(ref) > 600  # the whole model, not a fragment


@pytest.mark.slow
def test_full_size_sd15_forward_matches_diffusers():
    """The real SD 1.5 architecture (860M parameters), random fp32 weights, a 32x32 latent.

    Measured: max abs error 2.3e-6 on outputs ~1.3; peak memory ~7.5 GB (torch model + JAX copy)."""
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(**SD15_UNET).eval()
    with torch.no_grad():  # move norms and zero-initialised biases away from 1 / 0
        for key, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.05)
    tensors = {k: v.numpy() for k, v in model.state_dict().items()}  # shares torch's memory
    unet = build_unet_condition(UNet2DConditionConfig.from_dict(SD15_UNET), tensors)
    del tensors
    inputs = tiny_inputs(SD15_UNET, batch=1, height=32, width=32, tokens=77, seed=9)
    ref = torch_output(model, inputs)
    del model
    out = jax_output(unet, inputs, jit=True)
    err = _max_err(out, ref)
    assert err <= 1e-3, f"max abs error {err:.3g}"
    assert np.abs(ref).max() > 0.1


# ----------------------------------------------------------------------------------------------
# Bad inputs: one line, naming the problem


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("override,needle", [
    ({"down_block_types": ["SimpleCrossAttnDownBlock2D", "DownBlock2D"]}, "down_block_types 'SimpleCrossAttnDownBlock2D'"),
    ({"up_block_types": ["UpBlock2D", "AttnUpBlock2D"]}, "up_block_types 'AttnUpBlock2D'"),
    ({"mid_block_type": "UNetMidBlock2DSimpleCrossAttn"}, "mid_block_type"),
    ({"only_cross_attention": True}, "only_cross_attention"),
    ({"class_embed_type": "timestep"}, "class_embed_type"),
    ({"addition_embed_type": "text"}, "addition_embed_type 'text'"),
    ({"time_embedding_type": "fourier"}, "time_embedding_type"),
    ({"resnet_time_scale_shift": "scale_shift"}, "resnet_time_scale_shift"),
    ({"encoder_hid_dim": 64}, "encoder_hid_dim"),
    ({"dual_cross_attention": True}, "dual_cross_attention"),
    ({"cross_attention_dim": [32, 32]}, "cross_attention_dim"),
    ({"attention_head_dim": [2, 4, 8]}, "attention_head_dim has 3 entries but down_block_types has 2"),
    ({"num_attention_heads": [2, 4, 8]}, "num_attention_heads has 3 entries"),
    ({"transformer_layers_per_block": [[1], [2]]}, "transformer_layers_per_block entry"),
    ({"addition_embed_type": "text_time"}, "addition_time_embed_dim"),
    ({"some_future_option": 1}, "some_future_option"),
])
def test_unsupported_config_is_refused_by_name(override, needle):
    raw = {"_class_name": "UNet2DConditionModel", **tiny_config("sd1"), **override}
    with pytest.raises(UnsupportedConfigError) as info:
        UNet2DConditionConfig.from_dict(raw)
    msg = _one_line(info.value)
    assert needle in msg, msg


def test_unsupported_option_lists_what_is_supported():
    raw = {**tiny_config("sd1"), "down_block_types": ["AttnDownBlock2D", "DownBlock2D"]}
    with pytest.raises(UnsupportedConfigError) as info:
        UNet2DConditionConfig.from_dict(raw)
    assert _one_line(info.value).endswith("supported: 'CrossAttnDownBlock2D', 'DownBlock2D'")


def test_pipeline_folder_loads_its_unet(tiny, tmp_path):
    """A pipeline folder (model_index.json + unet/) loads the same tensors as the bare unet/ folder."""
    path, _ = tiny("sd2")
    shutil.copytree(path, tmp_path / "pipe" / "unet")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps(
        {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}))
    a, b = load_unet_condition(tmp_path / "pipe"), load_unet_condition(path)
    assert a.config == b.config
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_wrong_class_and_mismatched_weights_are_one_line(tiny, tmp_path):
    path, _ = tiny("sd1")
    bare = shutil.copytree(path, tmp_path / "bare")
    raw = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**raw, "_class_name": "UNet2DModel"}))
    with pytest.raises(UnsupportedConfigError, match="supported: 'UNet2DConditionModel'") as info:
        load_unet_condition(bare)
    _one_line(info.value)
    (bare / "config.json").write_text(json.dumps({**raw, "cross_attention_dim": 48}))
    with pytest.raises(WeightsError, match="attn2.to_k.weight has shape") as info:
        load_unet_condition(bare)
    _one_line(info.value)


def test_mis_shaped_inputs_are_one_line(tiny):
    path, _ = tiny("sdxl")
    unet = load_unet_condition(path)
    good = tiny_inputs(tiny_config("sdxl"), batch=2)
    added = {"text_embeds": good["text_embeds"], "time_ids": good["time_ids"]}
    cases = [
        ((good["sample"][:, :3], good["timestep"], good["encoder_hidden_states"], added), "sample must be"),
        ((good["sample"][0], good["timestep"], good["encoder_hidden_states"], added), "sample must be"),
        ((good["sample"], good["timestep"], good["encoder_hidden_states"][..., :16], added),
         "encoder_hidden_states must be (2, L, 32)"),
        ((good["sample"], good["timestep"], good["encoder_hidden_states"][:1], added), "encoder_hidden_states must be"),
        ((good["sample"], np.zeros(3), good["encoder_hidden_states"], added), "timestep must be"),
        ((good["sample"], good["timestep"], good["encoder_hidden_states"], None), "needs added_cond text_embeds, time_ids"),
        ((good["sample"], good["timestep"], good["encoder_hidden_states"], {**added, "text_embeds": np.zeros((2, 8))}),
         "projection_class_embeddings_input_dim is 64"),
        ((good["sample"], good["timestep"], good["encoder_hidden_states"], {**added, "time_ids": np.zeros((2, 6, 1))}),
         "text_embeds and time_ids must be"),
    ]
    for args, needle in cases:
        with pytest.raises(InvalidArgumentError) as info:
            unet(*args)
        msg = _one_line(info.value)
        assert needle in msg, msg


def test_text_encoder_width_mismatch_is_refused(tiny):
    path, _ = tiny("sdxl")
    unet = load_unet_condition(path)
    unet.check_text_conditioning(32, TINY_POOLED_WIDTH["sdxl"])  # the widths it was built for
    with pytest.raises(ModelFormatError) as info:
        unet.check_text_conditioning(768)
    assert "cross_attention_dim 32 but the text encoder gives 768-wide" in _one_line(info.value)
    with pytest.raises(ModelFormatError) as info:
        check_text_conditioning(unet.config, 32, pooled_width=1280)
    assert "projection_class_embeddings_input_dim 64" in _one_line(info.value)


def test_architecture_dict_tracks_the_program_not_bookkeeping():
    a = UNet2DConditionConfig.from_dict(tiny_config("sd1"))
    b = UNet2DConditionConfig.from_dict(tiny_config("sd1", sample_size=64, dropout=0.1))
    c = UNet2DConditionConfig.from_dict(tiny_config("sd1", upcast_attention=True))
    assert a.architecture_dict() == b.architecture_dict()
    assert a.architecture_dict() != c.architecture_dict()
    json.dumps(a.architecture_dict())  # a cache key must serialise
