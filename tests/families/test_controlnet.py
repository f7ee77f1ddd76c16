"""SD 1.x and SDXL with a ControlNet (``preheat.load(folder, controlnet=...)``) against diffusers'
StableDiffusionControlNetPipeline / StableDiffusionXLControlNetPipeline on tiny random folders,
from the same initial latents; and the ControlNet inputs' checks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

import preheat
from preheat.errors import InvalidArgumentError, ModelNotFoundError, UnsupportedConfigError
from tests._support.controlnet_fixtures import control_image, reference_controlnet_pipeline, save_tiny_controlnet
from tests._support.numerics import mean_abs_px, px_diff
from tests._support.sd_fixtures import reference_pixels, save_tiny_sd

pytestmark = pytest.mark.usefixtures("one_compile_per_program")

MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255, as test_stable_diffusion


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """kind -> (pipeline folder, ControlNet folder), built on first use."""
    base = tmp_path_factory.mktemp("controlnet")
    built = {}

    def get(kind):
        if kind not in built:
            sd = save_tiny_sd(base / kind, kind=kind)
            built[kind] = (sd, save_tiny_controlnet(base / f"{kind}-controlnet", sd))
        return built[kind]

    return get


def _noise(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 4, 16, 16)).astype(np.float32)


# (kind, sampler, guidance, two calls' (scale, start, end)): the second call's scale and window are data
CASES = [("sd1", "euler", 6.0, [(0.6, 0.25, 0.75), (1.3, 0.0, 0.5)]),
         ("sdxl", "dpmpp_2m", 5.0, [(0.6, 0.25, 0.75), (1.5, 0.5, 1.0)])]


@pytest.mark.slow  # builds two pipelines a case (diffusers' and ours) and compiles ours
@pytest.mark.parametrize("kind,sampler,guidance,calls", CASES, ids=[c[0] for c in CASES])
def test_matches_diffusers_controlnet_pipelines(folders, kind, sampler, guidance, calls):
    sd, cn = folders(kind)
    ref = reference_controlnet_pipeline(sd, cn, sampler)
    pipe = preheat.load(sd, controlnet=cn, cache="off")
    image = control_image(seed=2)
    noise = _noise()
    outs = []
    for i, (scale, start, end) in enumerate(calls):
        window = dict(control_guidance_start=start, control_guidance_end=end)
        theirs = reference_pixels(ref, "a photo of a cat", noise, image=Image.fromarray(image), num_inference_steps=4,
                                  height=32, width=32, guidance_scale=guidance, controlnet_conditioning_scale=scale,
                                  **window)
        ours = pipe.generate("a photo of a cat", noise=noise, steps=4, sampler=sampler, guidance=guidance,
                             control_image=image, controlnet_conditioning_scale=scale, **window)
        assert ours.shape == theirs.shape == (1, 32, 32, 3)  # the control image's size
        diff = px_diff(ours, theirs)
        print(f"{kind}/{sampler} scale {scale} window [{start}, {end}]: mean |Δpx| {diff.mean():.4f}, "
              f"max {diff.max()}")
        assert diff.mean() <= MEAN_TOL, (diff.mean(), diff.max())
        assert ours.std() > 5
        if i:  # a new scale and window: the same program, from memory
            assert pipe.last.stages["denoise"].cache_layer == "memory"
        outs.append(ours)
    off = pipe.generate("a photo of a cat", noise=noise, steps=4, sampler=sampler, guidance=guidance,
                        control_image=image, controlnet_conditioning_scale=0.0)
    assert pipe.last.stages["denoise"].cache_layer == "memory"
    whole = pipe.generate("a photo of a cat", noise=noise, steps=4, sampler=sampler, guidance=guidance,
                          control_image=image, controlnet_conditioning_scale=calls[0][0])
    for out, other in ((outs[0], off), (outs[1], off), (outs[0], whole)):
        # the ControlNet moves the pixels, and so does its window: a scale or window the program ignored
        # would give the other image
        assert mean_abs_px(out, other) > 3 * MEAN_TOL


@pytest.mark.slow  # loads two pipelines (no compile) after building the folders
def test_a_controlnet_is_part_of_the_program_identity_and_its_weights_are_arguments(folders, tmp_path):
    """The ControlNet's architecture and dtype are in the denoiser's fingerprint (a model without one,
    or with another architecture, has its own cache entries); its weights are the program's
    arguments, like the UNet's, so two ControlNets of one architecture share a program and each
    draws with its own weights."""
    sd, cn = folders("sd1")
    other = save_tiny_controlnet(tmp_path / "other", sd, seed=5)
    plain = preheat.load(sd, cache="off")
    first = preheat.load(sd, controlnet=cn, cache="off")
    second = preheat.load(sd, controlnet=other, cache="off")
    assert "controlnet" not in plain.fingerprint
    assert first.fingerprint["controlnet"]["config"]["conditioning_embedding_out_channels"] == [16, 32]
    assert first.fingerprint == second.fingerprint
    a = first.params[1]["controlnet_mid_block"]["kernel"][...]
    b = second.params[1]["controlnet_mid_block"]["kernel"][...]
    assert not np.allclose(np.asarray(a), np.asarray(b))  # (each call passes its own: DenoiseArgs.params)


@pytest.mark.slow  # builds a tiny folder and ControlNet with diffusers and loads them (no compile)
def test_control_inputs_are_declared_checked_and_refused_in_one_line(folders, tmp_path):
    sd, cn = folders("sd1")
    plain = preheat.load(sd, cache="off")
    pipe = preheat.load(sd, controlnet=cn, cache="off")
    names = [s.name for s in pipe.family.input_specs(pipe)]
    assert names[-4:] == ["control_image", "controlnet_conditioning_scale", "control_guidance_start",
                          "control_guidance_end"]
    assert "control_image" not in [s.name for s in plain.family.input_specs(plain)]
    image = control_image(48, 40)
    request = pipe.validate("a cat", control_image=image)  # the control image's size, as diffusers' prepare_image
    assert (request.values["width"], request.values["height"]) == (40, 48)
    assert pipe.validate("a cat", control_image=image, width=32, height=32).values["width"] == 32

    def refused(p, needle, **inputs):
        with pytest.raises(InvalidArgumentError, match=needle) as info:
            p.check("a cat", steps=4, **inputs)
        assert "\n" not in str(info.value)

    refused(plain, "control_image needs a ControlNet: load the model with controlnet=", control_image=image)
    refused(plain, "controlnet_conditioning_scale needs a ControlNet", controlnet_conditioning_scale=0.5)
    refused(pipe, "control_image is required")
    refused(pipe, r"controlnet_conditioning_scale=-1 must be a finite number in \[0, 10\]", control_image=image,
            controlnet_conditioning_scale=-1)
    refused(pipe, r"control_guidance_end=1.5 must be a finite number in \[0, 1\]", control_image=image,
            control_guidance_end=1.5)
    refused(pipe, "control_guidance_start=0.5 must be below control_guidance_end=0.5", control_image=image,
            control_guidance_start=0.5, control_guidance_end=0.5)
    refused(pipe, "image is not supported with a ControlNet yet", control_image=image, image=image)
    refused(pipe, "strength is not supported with a ControlNet yet", control_image=image, strength=0.5)
    assert not {"image", "mask_image", "strength"} & set(names)
    refused(pipe, "'heun' does not", control_image=image, sampler="heun", control_guidance_end=0.5)
    pipe.check("a cat", steps=4, control_image=image, sampler="heun")  # the whole window: any sampler

    with pytest.raises(InvalidArgumentError, match="backend='jax'"):
        preheat.load(sd, backend="torch", controlnet=cn)
    with pytest.raises(ModelNotFoundError, match="local folder"):
        preheat.load(sd, controlnet="hf://org/some-controlnet", cache="off")
    xl, xl_cn = folders("sdxl")
    with pytest.raises(UnsupportedConfigError, match="does not fit this model") as info:
        preheat.load(sd, controlnet=xl_cn, cache="off")  # an SDXL ControlNet on SD 1.x
    assert "\n" not in str(info.value)
    pooled = tmp_path / "pooled"
    shutil.copytree(cn, pooled)
    config = json.loads((pooled / "config.json").read_text())
    (pooled / "config.json").write_text(json.dumps({**config, "global_pool_conditions": True}))
    with pytest.raises(UnsupportedConfigError, match="guess mode"):
        preheat.load(sd, controlnet=pooled, cache="off")
