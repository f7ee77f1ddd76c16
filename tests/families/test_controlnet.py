"""SD 1.x and SDXL with a ControlNet (``preheat.load(folder, controlnet=...)``) against diffusers'
StableDiffusion[XL]ControlNetPipeline on tiny random folders, from the same initial latents, and
against its ControlNet img2img and inpaint pipelines (4- and 9-channel UNets) from the same ε
(``tests/_support/image_fixtures``: a VAE posterior of negligible variance, diffusers' ε replayed);
and the ControlNet inputs' checks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from PIL import Image

import preheat
from preheat.errors import InvalidArgumentError, ModelNotFoundError, SchedulerConfigError, UnsupportedConfigError
from tests._support import image_fixtures
from tests._support.controlnet_fixtures import (control_image, reference_controlnet_image_pipeline,
                                                reference_controlnet_pipeline, save_tiny_controlnet)
from tests._support.numerics import mean_abs_px, px_diff
from tests._support.sd_fixtures import reference_pixels, save_tiny_sd


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
    assert names[-5:] == ["control_image", "controlnet_conditioning_scale", "control_guidance_start",
                          "control_guidance_end", "guess_mode"]
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
    refused(pipe, "'heun' does not", control_image=image, sampler="heun", control_guidance_end=0.5)
    pipe.check("a cat", steps=4, control_image=image, sampler="heun")  # the whole window: any sampler

    with pytest.raises(ModelNotFoundError, match="does not exist"):  # (hf:// sources: tests/store/test_companion_sources.py)
        preheat.load(sd, controlnet=str(sd) + "-no-such-controlnet", cache="off")
    xl, xl_cn = folders("sdxl")
    with pytest.raises(UnsupportedConfigError, match="does not fit this model") as info:
        preheat.load(sd, controlnet=xl_cn, cache="off")  # an SDXL ControlNet on SD 1.x
    assert "\n" not in str(info.value)
    assert pipe.validate("a cat", control_image=image).values["guess_mode"] is False
    assert pipe.validate("a cat", control_image=image, guess_mode=True).values["guess_mode"] is True
    pooled = tmp_path / "pooled"
    shutil.copytree(cn, pooled)
    config = json.loads((pooled / "config.json").read_text())
    (pooled / "config.json").write_text(json.dumps({**config, "global_pool_conditions": True}))
    pooled_pipe = preheat.load(sd, controlnet=pooled, cache="off")  # diffusers' guess_mode or global_pool_conditions
    assert pooled_pipe.validate("a cat", control_image=image, guess_mode=False).values["guess_mode"] is True


# ------------------------------------------------------------------------------ guess mode

# (kind, sampler, guidance): guided, the ControlNet on the conditional branch only; unguided, the ramp alone
GUESS_CASES = [("sd1", "euler", 6.0), ("sd1", "euler", 1.0), ("sdxl", "dpmpp_2m", 5.0), ("sdxl", "dpmpp_2m", 1.0)]


@pytest.mark.slow  # builds diffusers' pipeline and compiles ours, per case
@pytest.mark.parametrize("kind,sampler,guidance", GUESS_CASES, ids=[f"{c[0]}-cfg{c[2]:g}" for c in GUESS_CASES])
def test_guess_mode_matches_diffusers(folders, kind, sampler, guidance):
    """diffusers' guess_mode=True: with guidance the ControlNet runs on the conditional branch only
    (the unconditional branch's residuals are zeros), and its residuals are scaled by the ramp
    logspace(-1, 0) (down blocks, then mid) times the scale; without guidance, the ramp alone. Guess
    mode is data: the program a call without it compiled."""
    sd, cn = folders(kind)
    ref = reference_controlnet_pipeline(sd, cn, sampler)
    pipe = preheat.load(sd, controlnet=cn, cache="off")
    image, noise = control_image(seed=2), _noise()
    call = dict(noise=noise, steps=4, sampler=sampler, guidance=guidance, control_image=image,
                controlnet_conditioning_scale=0.9, control_guidance_end=0.75)
    plain = pipe.generate("a photo of a cat", **call)
    ours = pipe.generate("a photo of a cat", **call, guess_mode=True)
    assert pipe.last.stages["denoise"].cache_layer == "memory"
    theirs = reference_pixels(ref, "a photo of a cat", noise, image=Image.fromarray(image), num_inference_steps=4,
                              height=32, width=32, guidance_scale=guidance, controlnet_conditioning_scale=0.9,
                              control_guidance_end=0.75, guess_mode=True)
    diff = px_diff(ours, theirs)
    print(f"{kind}/{sampler} guidance {guidance} guess mode: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.mean() <= MEAN_TOL, (diff.mean(), diff.max())
    assert ours.std() > 5
    assert mean_abs_px(ours, plain) > 3 * MEAN_TOL  # guess mode the program ignored would give the plain image


@pytest.mark.slow  # builds a pooled ControlNet and diffusers' pipeline, compiles ours, per case
@pytest.mark.parametrize("kind", ["sd1", "sdxl"])
def test_a_global_pool_controlnet_runs_guess_mode_as_diffusers(folders, kind, tmp_path):
    """A ``global_pool_conditions`` ControlNet (lllyasviel's shuffle): each residual averaged over the
    image, and guess mode always on, whatever the call asks (diffusers' ``guess_mode or
    global_pool_conditions``): the conditional branch only, its residuals unramped."""
    sd, _ = folders(kind)
    pooled = save_tiny_controlnet(tmp_path / "pooled", sd, global_pool_conditions=True)
    ref = reference_controlnet_pipeline(sd, pooled, "euler")
    pipe = preheat.load(sd, controlnet=pooled, cache="off")
    image, noise = control_image(seed=2), _noise()
    call = dict(noise=noise, steps=4, sampler="euler", guidance=5.0, control_image=image)
    ours = pipe.generate("a photo of a cat", **call, controlnet_conditioning_scale=1.5, guess_mode=False)
    theirs = reference_pixels(ref, "a photo of a cat", noise, image=Image.fromarray(image), num_inference_steps=4,
                              height=32, width=32, guidance_scale=5.0, controlnet_conditioning_scale=1.5,
                              guess_mode=False)
    diff = px_diff(ours, theirs)
    print(f"{kind} pooled ControlNet: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.mean() <= MEAN_TOL, (diff.mean(), diff.max())
    off = pipe.generate("a photo of a cat", **call, controlnet_conditioning_scale=0.0)
    assert mean_abs_px(ours, off) > 3 * MEAN_TOL  # the pooled residuals move the pixels


def test_guess_mode_is_a_declared_switch_refused_in_one_line():
    """guess_mode is a ControlNet input (refused without one, naming the option that loads it), a
    bool on every surface: JSON true/false, the command line's true/false (1/0, yes/no, on/off)."""
    from preheat.families.control import GUESS_MODE, refuse_without_controlnet
    from preheat.families.inputs import typed_flags

    assert GUESS_MODE.check(None, 1) is False and GUESS_MODE.check(np.bool_(True), 1) is True
    assert GUESS_MODE.schema()["type"] == "boolean"
    assert typed_flags([GUESS_MODE], "stable-diffusion", {"--guess-mode": ["True"]}) == {"guess_mode": True}
    assert typed_flags([GUESS_MODE], "stable-diffusion", {"--guess-mode": ["off"]}) == {"guess_mode": False}
    for bad in ("yes", 1, 0.0):
        with pytest.raises(InvalidArgumentError, match=f"guess_mode={bad!r} must be true or false") as info:
            GUESS_MODE.check(bad, 1)
        assert info.value.argument == "guess_mode" and "\n" not in str(info.value)
    with pytest.raises(InvalidArgumentError, match="--guess-mode 'maybe' must be true or false"):
        typed_flags([GUESS_MODE], "stable-diffusion", {"--guess-mode": ["maybe"]})
    with pytest.raises(InvalidArgumentError, match="guess_mode needs a ControlNet: load the model with controlnet="):
        refuse_without_controlnet({"guess_mode": False})


# ------------------------------------------------------------------------------ img2img and inpainting

SHAPE = (1, 4, 16, 16)  # one image's latents, NCHW (32x32 pixels, VAE factor 2)


@pytest.fixture(scope="module")
def image_folders(tmp_path_factory):
    """(kind, variant) -> (pipeline folder, ControlNet folder), built on first use: ``image_fixtures``
    folders; variant "base" (4 UNet channels) or "inpaint" (9), the ControlNet made from the base UNet
    (it takes the latents alone beside a 9-channel UNet)."""
    base = tmp_path_factory.mktemp("controlnet-image")
    built = {}

    def get(kind, variant="base"):
        if (kind, variant) not in built:
            if (kind, "base") not in built:
                sd = image_fixtures.save_image_sd(base / kind, kind)
                built[kind, "base"] = (sd, save_tiny_controlnet(base / f"{kind}-controlnet", sd))
            if variant == "inpaint":
                folder = image_fixtures.save_image_sd(base / f"{kind}-inpaint", kind, inpaint=True)
                built[kind, variant] = (folder, built[kind, "base"][1])
        return built[kind, variant]

    return get


def _diffusers_keep(n: int, start: float, end: float) -> list[int]:
    """The steps diffusers' ``controlnet_keep`` applies the ControlNet at, of the n its loop runs."""
    return [i for i in range(n) if 1.0 - float(i / n < start or (i + 1) / n > end)]


def _image_call(folders, kind, variant, mode, sampler, strength, calls, image, mask, ctrl, **extra):
    """[(ours, diffusers')] for each of ``calls``' (scale, start, end) (None: the pipeline's
    defaults), and the loaded pipe. Strength 1 inpainting starts from the noise alone (given to
    diffusers as latents); else diffusers draws ε after the image's posterior sample, replayed here."""
    import torch

    folder, cn = folders(kind, variant)
    inpaint = mode == "inpaint"
    ref = reference_controlnet_image_pipeline(folder, cn, kind, sampler, inpaint)
    pipe = preheat.load(folder, controlnet=cn, cache="off")
    theirs_in = dict(image=Image.fromarray(image), control_image=Image.fromarray(ctrl), num_inference_steps=5,
                     guidance_scale=5.0, **extra)
    ours_in = dict(image=image, control_image=ctrl, steps=5, guidance=5.0, sampler=sampler, **extra)
    if inpaint:
        theirs_in["mask_image"], ours_in["mask_image"] = Image.fromarray(mask), mask
    if strength is not None:
        theirs_in["strength"] = ours_in["strength"] = strength
    h, w = image.shape[:2]
    if inpaint and strength == 1.0:
        eps = np.random.default_rng(4).standard_normal((1, 4, h // 2, w // 2)).astype(np.float32)
        theirs_in["latents"] = torch.from_numpy(eps)
    else:
        eps = image_fixtures.replayed_noise((1, 4, h // 2, w // 2), 5, draws_before=1)
    pairs = []
    for call in calls:
        window = {} if call is None else dict(controlnet_conditioning_scale=call[0], control_guidance_start=call[1],
                                              control_guidance_end=call[2])
        theirs = image_fixtures.reference_pixels(ref, "a red boat", 5, **theirs_in, **window)
        ours = pipe.generate("a red boat", noise=eps, **ours_in, **window)
        pairs.append((ours, theirs))
    return pipe, pairs, ours_in, eps


# (kind, UNet, call, sampler, strength (None: the pipeline's default), two calls' (scale, start, end) or None:
# the pipeline's default scale and the whole window); windows counted over the steps strength leaves
IMAGE_CASES = [("sd1", "base", "img2img", "euler", 0.6, [(0.9, 0.25, 0.75), (1.3, 0.5, 1.0)]),
               ("sd1", "base", "inpaint", "ddim", 0.6, [(0.9, 0.25, 0.75), (1.3, 0.0, 0.5)]),  # mask blended
               ("sd1", "inpaint", "inpaint", "euler", 1.0, [(0.9, 0.25, 0.75), (1.3, 0.5, 1.0)]),
               ("sdxl", "base", "img2img", "dpmpp_2m", 0.6, [(0.9, 0.25, 0.75), (1.3, 0.5, 1.0)]),
               ("sdxl", "base", "inpaint", "euler", None, [None, (1.3, 0.25, 0.75)]),
               ("sdxl", "inpaint", "inpaint", "euler", 1.0, [(0.9, 0.25, 0.75), (1.3, 0.5, 1.0)])]


@pytest.mark.slow  # builds diffusers' pipeline and compiles ours, per case
@pytest.mark.parametrize("kind,variant,mode,sampler,strength,calls", IMAGE_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in IMAGE_CASES])
def test_controlnet_img2img_and_inpainting_match_diffusers(image_folders, kind, variant, mode, sampler, strength,
                                                           calls):
    """diffusers' StableDiffusion[XL]ControlNetImg2ImgPipeline / ...InpaintPipeline: the image
    noised at get_timesteps(strength)'s step (inpainting at strength 1: the noise alone), the
    ControlNet's window over the steps that run, a base UNet's mask blended after each step, a
    9-channel UNet's mask channels beside the sample (not the ControlNet's), and the pipelines'
    default strength and scale. The second call's scale and window are data: the same program."""
    image, mask, ctrl = image_fixtures.sample_image(seed=1), image_fixtures.sample_mask(), control_image(seed=2)
    pipe, pairs, ours_in, eps = _image_call(image_folders, kind, variant, mode, sampler, strength, calls, image,
                                            mask, ctrl)
    for i, ((ours, theirs), call) in enumerate(zip(pairs, calls)):
        diff = px_diff(ours, theirs)
        print(f"{kind}-{variant} {mode}/{sampler} strength {strength} call {call}: mean |Δpx| {diff.mean():.4f}, "
              f"max {diff.max()}")
        assert ours.shape == theirs.shape == (1, 32, 32, 3)
        assert diff.mean() <= MEAN_TOL, (diff.mean(), diff.max())
        if i:
            assert pipe.last.stages["denoise"].cache_layer == "memory"
    if strength is None:  # the ControlNet pipelines' own defaults, not the image pipelines' (SDXL img2img: 0.3)
        values = pipe.validate("a red boat", **ours_in).values
        assert (values["strength"], values["controlnet_conditioning_scale"]) == (0.9999 if mode == "inpaint" else 0.8,
                                                                                  1.0 if mode == "inpaint" else 0.8)
    scale, start, end = calls[-1]
    whole = pipe.generate("a red boat", noise=eps, **ours_in, controlnet_conditioning_scale=scale)
    off = pipe.generate("a red boat", noise=eps, **ours_in, controlnet_conditioning_scale=0.0)
    # the window and the ControlNet both move the pixels (a window or scale the program ignored would not)
    assert mean_abs_px(pairs[-1][0], whole) > 2 * MEAN_TOL and mean_abs_px(whole, off) > 2 * MEAN_TOL


@pytest.mark.slow  # builds diffusers' pipeline and compiles ours (a 48x32 image)
def test_controlnet_inpainting_with_padding_mask_crop_matches_diffusers(image_folders):
    """padding_mask_crop: the mask's box is cut from the image, the mask and the control image alike,
    each filled to the output's size (the image's, without width/height), and pasted back."""
    image, mask = image_fixtures.sample_image(seed=1, width=48), image_fixtures.corner_mask(32, 48)
    ctrl = control_image(32, 48, seed=3)
    _, pairs, _, _ = _image_call(image_folders, "sd1", "base", "inpaint", "ddim", 0.6, [(0.9, 0.0, 1.0)], image,
                                 mask, ctrl, padding_mask_crop=2)
    ((ours, theirs),) = pairs
    diff = px_diff(ours, theirs)
    print(f"padding_mask_crop: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert ours.shape == theirs.shape == (1, 32, 48, 3) and diff.mean() <= MEAN_TOL
    np.testing.assert_array_equal(ours[0][mask == 0], image[mask == 0])


@pytest.mark.slow  # builds a pooled ControlNet and diffusers' pipeline, compiles ours
def test_sdxl_controlnet_inpainting_keeps_a_pooled_controlnet_off_guess_mode(image_folders, tmp_path):
    """diffusers' SDXL ControlNet inpaint pipeline alone does not turn guess mode on for a
    global_pool_conditions ControlNet: its pooled residuals reach both branches unless the call asks."""
    folder, _ = image_folders("sdxl")
    pooled = save_tiny_controlnet(tmp_path / "pooled", folder, global_pool_conditions=True)
    image, mask, ctrl = image_fixtures.sample_image(seed=1), image_fixtures.sample_mask(), control_image(seed=2)
    pipe, pairs, ours_in, _ = _image_call(lambda kind, variant: (folder, pooled), "sdxl", "base", "inpaint", "euler",
                                          0.6, [(1.5, 0.0, 1.0)], image, mask, ctrl)
    ((ours, theirs),) = pairs
    diff = px_diff(ours, theirs)
    print(f"sdxl inpainting, pooled ControlNet: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.mean() <= MEAN_TOL, (diff.mean(), diff.max())
    assert pipe.validate("a red boat", **ours_in).values["guess_mode"] is False
    assert pipe.validate("a red boat", **{**ours_in, "mask_image": None}).values["guess_mode"] is True  # img2img


@pytest.mark.slow  # builds an SDXL folder and ControlNet (no compile)
def test_sdxl_controlnet_inpainting_refuses_negative_size_ids(image_folders, tmp_path):
    """diffusers' SDXL ControlNet inpaint pipeline gives the unconditional branch the prompt's ids
    and takes no negative sizes (its img2img pipeline does, as the image pipelines: see the parity
    cases); a ControlNet made from a 9-channel UNet (in_channels 9) fits no pipeline that feeds it."""
    from diffusers import UNet2DConditionModel

    folder, cn = image_folders("sdxl")
    pipe = preheat.load(folder, controlnet=cn, cache="off")
    image, ctrl = image_fixtures.sample_image(), control_image()
    for name in ("negative_original_size", "negative_target_size", "negative_crops_coords_top_left"):
        with pytest.raises(InvalidArgumentError, match="does not apply to ControlNet inpainting") as info:
            pipe.validate("a cat", image=image, mask_image=image_fixtures.sample_mask(), control_image=ctrl,
                          **{name: (40, 40)})
        assert info.value.argument == name and "\n" not in str(info.value)
    pipe.validate("a cat", image=image, control_image=ctrl, negative_original_size=(40, 40))  # img2img: its own
    inpaint, _ = image_folders("sdxl", "inpaint")
    assert UNet2DConditionModel.load_config(inpaint / "unet")["in_channels"] == 9
    wrong = save_tiny_controlnet(tmp_path / "nine", inpaint)
    with pytest.raises(UnsupportedConfigError, match="in_channels 9, the model's 4"):
        preheat.load(inpaint, controlnet=wrong, cache="off")


def test_controlnet_image_inputs_sizes_defaults_and_window(image_folders):
    """With a ControlNet the model declares img2img and inpainting; the output takes the image's
    size, which the control image must share unless width/height resize both (diffusers prepares
    each at its own size, and its ControlNet then fails); the ControlNet pipelines' defaults; the
    window counted over the steps strength leaves, as diffusers' controlnet_keep over its truncated
    timesteps. Host side only: nothing compiles."""
    from preheat.families import request as request_of
    from preheat.families.control import control_window

    folder, cn = image_folders("sd1")
    pipe = preheat.load(folder, controlnet=cn, cache="off")
    names = [s.name for s in pipe.family.input_specs(pipe)]
    assert {"image", "mask_image", "strength", "padding_mask_crop", "control_image"} <= set(names)
    image, ctrl = image_fixtures.sample_image(40, width=48), control_image(40, 48)
    mask = np.zeros((40, 48), np.uint8)
    mask[8:24, 8:24] = 255
    text = pipe.validate("a cat", control_image=ctrl).values
    img2img = pipe.validate("a cat", image=image, control_image=ctrl).values
    inpaint = pipe.validate("a cat", image=image, mask_image=mask, control_image=ctrl).values
    assert text["controlnet_conditioning_scale"] == 1.0
    assert (img2img["strength"], img2img["controlnet_conditioning_scale"]) == (0.8, 0.8)
    assert (inpaint["strength"], inpaint["controlnet_conditioning_scale"]) == (1.0, 0.5)
    # the image's size, inpainting too (a base model's inpainting without a ControlNet: the UNet's native size)
    assert (img2img["width"], img2img["height"]) == (inpaint["width"], inpaint["height"]) == (48, 40)
    resized = pipe.validate("a cat", image=image, control_image=control_image(32, 32), width=32, height=32).values
    assert (resized["width"], resized["height"]) == (32, 32)

    def refused(needle, argument, error=InvalidArgumentError, **inputs):
        with pytest.raises(error, match=needle) as info:
            pipe.check("a cat", steps=5, **inputs)
        assert info.value.argument == argument and "\n" not in str(info.value)

    refused("control_image is 32x32 but image is 48x40 .* give them the same size, or width/height",
            "control_image", image=image, control_image=control_image(32, 32))
    refused("control_image is 32x32 but image is 48x40 .* give them the same size", "control_image", image=image,
            mask_image=mask, control_image=control_image(32, 32))
    refused("with padding_mask_crop they must be the same size", "control_image", image=image, mask_image=mask,
            padding_mask_crop=2, control_image=control_image(32, 32), width=32, height=32)
    refused("strength=0.1 with steps=5 runs no step", "strength", SchedulerConfigError, image=image,
            control_image=ctrl, strength=0.1)
    refused("'heun' does not", "control_guidance_start", image=image, control_image=ctrl, sampler="heun",
            control_guidance_end=0.5)
    refused("mask_image needs image", "mask_image", mask_image=mask, control_image=ctrl)

    request = pipe.check("a cat", image=image, control_image=ctrl, strength=0.6, steps=5, sampler="euler",
                         control_guidance_start=0.25, control_guidance_end=0.75)
    start = pipe.family.check_start(pipe, request)
    assert start == 2  # get_timesteps: 5 - int(5 * 0.6)
    t = np.asarray(request_of.plan(pipe, request).timesteps[:5])
    high, low = control_window(pipe, request, start)
    applied = [i for i in range(start, 5) if low <= t[i] <= high]
    assert applied == [start + i for i in _diffusers_keep(5 - start, 0.25, 0.75)] == [3]
    assert applied != _diffusers_keep(5, 0.25, 0.75)  # over all five steps it would be step 2
