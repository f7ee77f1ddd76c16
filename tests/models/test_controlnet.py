"""preheat.models.controlnet against diffusers' ControlNetModel, and the JAX UNet's residual inputs
against diffusers' UNet2DConditionModel given the same residuals, on tiny random configs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from preheat.errors import InvalidArgumentError, UnsupportedConfigError
from preheat.models.controlnet import ControlNetConfig, load_controlnet
from preheat.models.unet2d_condition import load_unet_condition
from tests._support.controlnet_fixtures import save_tiny_controlnet
from tests._support.unet_condition_fixtures import save_tiny_unet_condition, tiny_config, tiny_inputs

FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """kind -> (UNet folder, ControlNet folder, torch UNet, torch ControlNet), built once per module."""
    from diffusers import ControlNetModel, UNet2DConditionModel

    out = {}

    def get(kind, unet=None, **options):
        key = (kind, json.dumps(unet, sort_keys=True), json.dumps(options, sort_keys=True))
        if key not in out:
            base = tmp_path_factory.mktemp(kind)
            unet_dir = save_tiny_unet_condition(base / "unet", kind, **(unet or {}))
            cn_dir = save_tiny_controlnet(base / "controlnet", unet_dir, **options)
            out[key] = (unet_dir, cn_dir, UNet2DConditionModel.from_pretrained(unet_dir).eval(),
                        ControlNetModel.from_pretrained(cn_dir).eval())
        return out[key]

    return get


def _control(batch: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 1, (batch, 3, 16, 16)).astype(np.float32)  # NCHW in [0, 1]


def _torch_controlnet(model, inputs, control, scale, guess_mode=False):
    import torch

    added = None
    if "text_embeds" in inputs:
        added = {k: torch.from_numpy(inputs[k]) for k in ("text_embeds", "time_ids")}
    with torch.no_grad():
        down, mid = model(torch.from_numpy(inputs["sample"]), torch.from_numpy(inputs["timestep"]),
                          encoder_hidden_states=torch.from_numpy(inputs["encoder_hidden_states"]),
                          controlnet_cond=torch.from_numpy(control), conditioning_scale=scale,
                          added_cond_kwargs=added, guess_mode=guess_mode, return_dict=False)
    return [d.numpy() for d in down], mid.numpy()


def _added(inputs):
    return {"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]} if "text_embeds" in inputs else None


CASES = [("sd1", {}), ("sdxl", {}), ("sd2-bgr", {"controlnet_conditioning_channel_order": "bgr"}),
         ("sdxl-scanned", {})]  # 3 blocks per transformer: scanned over layer-stacked weights
UNETS = {"sdxl-scanned": dict(transformer_layers_per_block=[1, 3])}


# each builds diffusers models and runs them eagerly in JAX (a few seconds): slow
@pytest.mark.slow
@pytest.mark.parametrize("name,options", CASES, ids=[c[0] for c in CASES])
def test_residuals_match_diffusers(built, name, options):
    kind = name.split("-")[0]
    unet = UNETS.get(name)
    _, cn_dir, _, model = built(kind, unet, **options)
    cn = load_controlnet(cn_dir)
    inputs = tiny_inputs(tiny_config(kind, **(unet or {})), batch=2, seed=0)
    control = _control(2)
    ref_down, ref_mid = _torch_controlnet(model, inputs, control, 0.7)
    down, mid = cn(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], control, 0.7, _added(inputs))
    levels, layers = len(tiny_config(kind)["block_out_channels"]), tiny_config(kind)["layers_per_block"]
    assert len(down) == len(ref_down) == 1 + levels * layers + levels - 1  # conv_in's, resnets', downsamplers'
    for i, (ours, theirs) in enumerate(zip(down, ref_down)):
        assert ours.shape == theirs.shape, (i, ours.shape, theirs.shape)
        assert np.abs(np.asarray(ours) - theirs).max() <= FP32_TOL, (i, np.abs(np.asarray(ours) - theirs).max())
        assert np.abs(theirs).max() > 0.05  # a real signal: the zero convs were perturbed
    assert np.abs(np.asarray(mid) - ref_mid).max() <= FP32_TOL
    # the scale multiplies every residual (one per image too: data, not a constant)
    down1, _ = cn(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], control,
                  np.asarray([0.7, 0.0], np.float32), _added(inputs))
    np.testing.assert_allclose(np.asarray(down1[0])[0], np.asarray(down[0])[0], atol=1e-6)
    assert not np.asarray(down1[0])[1].any()
    # guess mode: diffusers' ramp, 0.1 at the first skip to 1 at the mid block, times the scale
    ref_down, ref_mid = _torch_controlnet(model, inputs, control, 0.7, guess_mode=True)
    down, mid = cn(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], control, 0.7, _added(inputs),
                   guess_mode=True)
    for ours, theirs in zip([*down, mid], [*ref_down, ref_mid]):
        assert np.abs(np.asarray(ours) - theirs).max() <= FP32_TOL
    ramp = np.abs(ref_down[0]).max() / np.abs(_torch_controlnet(model, inputs, control, 0.7)[0][0]).max()
    assert ramp == pytest.approx(0.1, rel=1e-5)  # a ramp the reference really applied


@pytest.mark.slow
def test_global_pool_conditions_averages_each_residual(built, tmp_path):
    """The shuffle ControlNet's option: each residual averaged over the image, as diffusers."""
    from diffusers import ControlNetModel

    _, cn_dir, _, _ = built("sd1")
    pooled = tmp_path / "pooled"
    model = ControlNetModel.from_pretrained(cn_dir, global_pool_conditions=True).eval()
    model.save_pretrained(pooled)
    inputs = tiny_inputs(tiny_config("sd1"), batch=1, seed=2)
    control = _control(1, seed=3)
    cn = load_controlnet(pooled)
    for guess_mode in (False, True):  # guess mode leaves a pooled ControlNet's residuals unramped, as diffusers
        ref_down, ref_mid = _torch_controlnet(model, inputs, control, 0.8, guess_mode=guess_mode)
        down, mid = cn(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], control, 0.8,
                       guess_mode=guess_mode)
        assert ref_mid.shape[2:] == (1, 1)
        for ours, theirs in zip([*down, mid], [*ref_down, ref_mid]):
            assert np.abs(np.asarray(ours) - theirs).max() <= FP32_TOL


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd1", "sdxl"])
def test_unet_adds_the_residuals_as_diffusers(built, kind):
    """The JAX UNet given a ControlNet's residuals (diffusers' down_block_additional_residuals /
    mid_block_additional_residual) equals diffusers' UNet given the same ones."""
    import torch

    unet_dir, _, torch_unet, model = built(kind)
    inputs = tiny_inputs(tiny_config(kind), batch=2, seed=4)
    down, mid = _torch_controlnet(model, inputs, _control(2, seed=5), 1.3)
    added = None
    if "text_embeds" in inputs:
        added = {k: torch.from_numpy(inputs[k]) for k in ("text_embeds", "time_ids")}
    with torch.no_grad():
        args = (torch.from_numpy(inputs["sample"]), torch.from_numpy(inputs["timestep"]))
        kwargs = dict(encoder_hidden_states=torch.from_numpy(inputs["encoder_hidden_states"]), added_cond_kwargs=added)
        ref = torch_unet(*args, **kwargs, down_block_additional_residuals=[torch.from_numpy(d) for d in down],
                         mid_block_additional_residual=torch.from_numpy(mid)).sample.numpy()
        plain = torch_unet(*args, **kwargs).sample.numpy()
    unet = load_unet_condition(unet_dir)
    ours = np.asarray(unet(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], _added(inputs),
                           down_block_additional_residuals=down, mid_block_additional_residual=mid))
    assert np.abs(ours - ref).max() <= FP32_TOL
    assert np.abs(ref - plain).max() > 0.05  # the residuals change the output


@pytest.mark.slow
def test_a_control_image_of_the_wrong_size_is_one_line(built):
    _, cn_dir, _, _ = built("sd1")
    cn = load_controlnet(cn_dir)
    inputs = tiny_inputs(tiny_config("sd1"), batch=1)
    with pytest.raises(InvalidArgumentError, match="control image is 8x8 but this ControlNet needs 16x16"):
        cn(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], np.zeros((1, 3, 8, 8), np.float32))


def _tiny_raw() -> dict:
    """A tiny ControlNetModel config.json as diffusers writes it for TINY_SD1 (no model built)."""
    unet_only = ("sample_size", "out_channels", "up_block_types")
    raw = {k: v for k, v in tiny_config("sd1").items() if k not in unet_only}
    return {"_class_name": "ControlNetModel", **raw, "conditioning_embedding_out_channels": [16, 32]}


def test_tiny_config_builds_and_unsupported_ones_are_one_line():
    from preheat.models.controlnet import build_abstract

    config = ControlNetConfig.from_dict(_tiny_raw())
    _, abstract = build_abstract(config)  # shapes only: no weights, no FLOPs
    assert config.downscale == 2 and config.unet_config().up_block_types == ("UpBlock2D", "CrossAttnUpBlock2D")
    from flax import nnx

    paths = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(abstract)}
    assert {"controlnet_down_blocks.5.kernel", "controlnet_mid_block.kernel",
            "controlnet_cond_embedding.blocks.1.kernel", "down_blocks.0.attentions.1.proj_in.kernel"} <= paths
    assert "controlnet_down_blocks.6.kernel" not in paths  # 1 + 2 levels x 2 layers + 1 downsampler
    for key, value, needle in (("mid_block_type", "UNetMidBlock2D", "mid_block_type"),
                               ("controlnet_conditioning_channel_order", "rgba", "channel_order"),
                               ("layers_per_block", [1, 2], "one int"),
                               ("down_block_types", ["SimpleDown", "DownBlock2D"], "down_block_types"),
                               ("flux_thing", 1, "config key")):
        with pytest.raises(UnsupportedConfigError, match=needle) as info:
            ControlNetConfig.from_dict({**_tiny_raw(), key: value})
        assert "\n" not in str(info.value)
