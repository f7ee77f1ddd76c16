"""A ControlNet's inputs (SD 1.x / 2.x, SDXL base): declared once, checked, and turned into conditioning.

A model loaded with ``controlnet=FOLDER`` (``preheat.models.controlnet``) declares five more
inputs, as diffusers' ``StableDiffusion[XL]ControlNet[Img2Img|Inpaint]Pipeline`` names them::

    input                          static / data            reaches
    -----------------------------  -----------------------  --------------------------------------
    control_image (required)       data (its size: static)  cond["control_image"] (n, H, W, 3) in
                                                            [0, 1]: resized to width x height (PIL
                                                            lanczos), not normalised to [-1, 1]
    controlnet_conditioning_scale  data (n,) float32        multiplies every residual
    control_guidance_start, _end   data (n, 2) float32      the steps the ControlNet applies in
    guess_mode (bool, False)       data (n, K) float32      each residual's factor beside the scale

beside the model's own ``image``, ``mask_image``, ``strength`` and ``padding_mask_crop``
(``families.image``): ControlNet img2img and inpainting, as diffusers' ControlNet img2img and
inpaint pipelines. What those pipelines do that their text-to-image one does not::

    what                      diffusers                                here
    ------------------------  ---------------------------------------  -----------------------------
    output size               the image's (rounded down to the VAE     the same; a control image of
                              factor), inpainting too; the control     another size is refused in one
                              image at its own: another size fails     line (width/height resize both)
                              in the ControlNet
    padding_mask_crop         the mask's box cut from the control      the same (each image's box);
                              image too, filled to the output size     the two images' sizes must agree
    the window                controlnet_keep over the timesteps       ``control_window(start=)``: the
                              get_timesteps(strength) leaves           call's first step
    defaults                  strength: 0.8 (img2img), 1.0 / 0.9999    the same (``StableDiffusionFamily.
                              (SD / SDXL inpainting); scale: 1, 0.8    control_strength``, ``control_scale``)
                              (img2img), 0.5 / 1.0 (SD / SDXL inpaint)
    a 9-channel UNet          the ControlNet takes the sample alone,   the same
                              before the mask channels join it
    SDXL negative ids         img2img: as the image pipelines;         the same; inpainting refuses
                              inpainting: the prompt's (it takes no    the negative sizes by name
                              negative sizes)

diffusers applies the ControlNet at step i of the N its loop runs when ``i / N >= start`` and
``(i + 1) / N <= end`` (its ``controlnet_keep``), scaling the residuals by 0 elsewhere. The
denoiser sees timesteps, not step indices, so the window travels as the timestep interval of the
kept steps (bounds halfway to the neighbouring steps' timesteps): data like the scale, and one
program serves every window and strength. That is exact for samplers that call the model once per
step at a timestep that falls with each step; others (Heun, DPM2: diffusers counts their two calls
per step as two steps) take the whole window only.

With classifier-free guidance the ControlNet runs on both branches (diffusers' default, guess mode
off), with the same control image and scale. Guess mode (diffusers' ``guess_mode=True``) runs it on
the conditional branch only, its residuals scaled by the ramp ``logspace(-1, 0, K)`` (the K - 1
skips, then the mid block) times the scale. The engine runs both branches as one batch, so guess
mode is data: a leaf of K factors per image, the ramp on the conditional branch and 0 on the
unconditional one (diffusers' zero residuals; the ControlNet still runs there), 1s with guess mode
off -- one program either way. A ``global_pool_conditions`` ControlNet (shuffle) is always in guess
mode, as diffusers' ``guess_mode or global_pool_conditions`` (its SDXL inpaint pipeline excepted:
there the call's own), with 1s for the ramp (diffusers ramps only unpooled residuals). Without
guidance guess mode changes the ramp alone.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from preheat.errors import InvalidArgumentError
from preheat.families.base import Conditioning, EngineView, Request
from preheat.families.inputs import WARM_IMAGE, Bool, Float, Image, InputSpec

__all__ = ["CONTROL_IMAGE", "CONTROLNET_CONDITIONING_SCALE", "CONTROL_GUIDANCE_START", "CONTROL_GUIDANCE_END",
           "GUESS_MODE", "CONTROL_SPECS", "CONTROL_NAMES", "refuse_without_controlnet", "check_control_inputs",
           "control_window", "control_cond", "keep_scale"]

# warm: a placeholder at each served size (its content is data; its size selects the program)
CONTROL_IMAGE = InputSpec("control_image", Image(), "The ControlNet's conditioning image (an edge map, a depth map, "
                          "a pose...), resized to the output's size: an http(s) URL or a data URI on a server, a "
                          "path on the command line.", required=True, warm=(WARM_IMAGE,), example=None)
CONTROLNET_CONDITIONING_SCALE = InputSpec("controlnet_conditioning_scale", Float(0.0, 10.0), "How strongly the "
                                          "ControlNet steers: its residuals are multiplied by this.",
                                          default_doc="the pipeline's own: 1; img2img 0.8; inpainting SD 0.5, "
                                          "SDXL 1")
CONTROL_GUIDANCE_START = InputSpec("control_guidance_start", Float(0.0, 1.0), "The share of the steps after which "
                                   "the ControlNet starts to apply.", default=0.0)
CONTROL_GUIDANCE_END = InputSpec("control_guidance_end", Float(0.0, 1.0), "The share of the steps after which "
                                 "the ControlNet stops applying.", default=1.0)
GUESS_MODE = InputSpec("guess_mode", Bool(), "Let the ControlNet steer without the prompt: with guidance it "
                       "applies to the conditional branch only, and its residuals are ramped from 0.1 (the finest) "
                       "to 1 (the mid block) times the scale. Always on for a global_pool_conditions ControlNet "
                       "(shuffle), as in diffusers.", default=False)
CONTROL_SPECS = (CONTROL_IMAGE, CONTROLNET_CONDITIONING_SCALE, CONTROL_GUIDANCE_START, CONTROL_GUIDANCE_END,
                 GUESS_MODE)
CONTROL_NAMES = tuple(s.name for s in CONTROL_SPECS)

_FAR = np.float32(1e9)  # beyond any timestep: an open end of the window


def refuse_without_controlnet(inputs: Mapping[str, Any]) -> None:
    """A ControlNet input given to a model loaded without one: one line saying how to load it."""
    given = [name for name in CONTROL_NAMES if inputs.get(name) is not None]
    if given:
        raise InvalidArgumentError(f"{given[0]} needs a ControlNet: load the model with controlnet=FOLDER "
                                   "(preheat sample/serve --controlnet FOLDER)", argument=given[0])


def check_control_inputs(pipe: EngineView, values: dict[str, Any], inputs: Mapping[str, Any], max_size: int,
                         scales: tuple[float, float, float]) -> None:
    """The window's order, the scale's default (``scales``: the text, img2img and inpaint pipelines'),
    guess mode forced on for a ``global_pool_conditions`` ControlNet, and the output size: without
    width/height the control image's own, rounded down to the size multiple (diffusers'
    ``prepare_image``); beside an image, the image's, which the control image must share (diffusers
    prepares each at its own size, and the ControlNet's sum of the two fails)."""
    from preheat.families.image import image_size

    if values["control_guidance_start"] >= values["control_guidance_end"]:
        raise InvalidArgumentError(f"control_guidance_start={values['control_guidance_start']:g} must be below "
                                   f"control_guidance_end={values['control_guidance_end']:g}",
                                   argument="control_guidance_start")
    control, image, mask_image = values["control_image"], values.get("image"), values.get("mask_image")
    config = pipe.components.controlnet
    if config.global_pool_conditions and not (config.addition_embed_type == "text_time" and mask_image is not None):
        values["guess_mode"] = True  # diffusers' guess_mode or global_pool_conditions (not its SDXL inpaint pipeline's)
    if values["controlnet_conditioning_scale"] is None:
        values["controlnet_conditioning_scale"] = scales[0 if image is None else 1 if mask_image is None else 2]
    if values.get("padding_mask_crop") is not None and control.shape[:2] != image.shape[:2]:
        (ch, cw), (h, w) = control.shape[:2], image.shape[:2]
        raise InvalidArgumentError(f"control_image is {cw}x{ch} but image is {w}x{h}; with padding_mask_crop they "
                                   "must be the same size (the mask's box is cut from both)", argument="control_image")
    if inputs.get("width") is not None or inputs.get("height") is not None:
        return  # both resized to width x height
    width, height = image_size(control, pipe.components.size_multiple)
    if image is not None:
        own = image_size(image, pipe.components.size_multiple)
        if own != (width, height):
            raise InvalidArgumentError(f"control_image is {width}x{height} but image is {own[0]}x{own[1]} (each "
                                       f"rounded down to a multiple of {pipe.components.size_multiple}); give them "
                                       "the same size, or width/height to resize both", argument="control_image")
    if max(width, height) > max_size:
        raise InvalidArgumentError(f"control_image is {width}x{height}; at most {max_size} a side for this model "
                                   "(give width/height to resize it)", argument="control_image")
    values["width"], values["height"] = width, height


def control_window(pipe: EngineView, request: Request, start: int = 0) -> np.ndarray:
    """(2,) float32: the (highest, lowest) timestep at which the ControlNet applies on this call,
    from diffusers' ``controlnet_keep`` over the steps the call runs (an image call's from ``start``,
    its ``get_timesteps(strength)`` step: diffusers counts over the truncated schedule); a window short
    of [0, 1] on a sampler it cannot be told to is one line."""
    from preheat.families import request as request_of
    from preheat.samplers import make_spec

    begin, end = request.values["control_guidance_start"], request.values["control_guidance_end"]
    if begin == 0.0 and end == 1.0:
        return np.asarray([_FAR, -_FAR], np.float32)
    spec = make_spec(request_of.scheduler_config(pipe, request), request.sampler)
    plan = request_of.plan(pipe, request)
    t = np.asarray(plan.timesteps[start:int(plan.n_steps)], np.float64)  # the model's t at each step run
    if spec.max_model_calls_per_step > 1 or len(t) > 1 and not np.all(np.diff(t) < 0):
        raise InvalidArgumentError(f"control_guidance_start/control_guidance_end need a sampler that calls the model "
                                   f"once per step at falling timesteps; {request.sampler!r} does not (use the whole "
                                   "window, 0 and 1, or another sampler)", argument="control_guidance_start")
    n = len(t)
    kept = [i for i in range(n) if not (i / n < begin or (i + 1) / n > end)]  # diffusers' controlnet_keep
    if not kept:
        return np.asarray([-_FAR, _FAR], np.float32)  # no step: an empty interval
    first, last = kept[0], kept[-1]
    high = _FAR if first == 0 else (t[first - 1] + t[first]) / 2
    low = -_FAR if last == n - 1 else (t[last] + t[last + 1]) / 2
    return np.asarray([high, low], np.float32)


def control_cond(pipe: EngineView, request: Request, start: int = 0) -> Conditioning:
    """The conditioning leaves a ControlNet call adds to each guidance branch: the control image as
    diffusers' ``control_image_processor`` prepares it (with padding_mask_crop, each image's box of
    it, filled to the output's size, as the image's), the scale, the window (``start``: an image
    call's first step), and each residual's factor (guess mode's ramp; 0 on the unconditional
    branch of a guided guess-mode call, whose residuals diffusers makes zeros)."""
    from preheat.families.image import crop_regions, unit_pixels
    from preheat.models.controlnet import residual_scales

    values, n = request.values, request.n
    regions = crop_regions(values) or (None,) * n
    prepared = {region: unit_pixels(values["control_image"], values["width"], values["height"], region)
                for region in set(regions)}  # (H, W, 3) each
    ramp = np.repeat(residual_scales(pipe.components.controlnet, values["guess_mode"])[None], n, axis=0)  # (n, K)
    cond = {"control_image": np.stack([prepared[r] for r in regions]),  # (n, H, W, 3) in [0, 1]
            "controlnet_conditioning_scale": np.full((n,), values["controlnet_conditioning_scale"], np.float32),
            "control_window": np.repeat(control_window(pipe, request, start)[None], n, axis=0),  # (n, 2)
            "control_residual_scales": ramp}
    uncond = {**cond, "control_residual_scales": np.zeros_like(ramp)} if values["guess_mode"] else cond
    return Conditioning(cond=cond, uncond=uncond)


def keep_scale(cond: Mapping[str, Any], t: Any) -> Any:
    """Inside the program: each residual's scale, each image's scale times its residual factor
    where its timestep is inside its window, else 0. (B, K)"""
    import jax.numpy as jnp

    window = cond["control_window"]  # (B, 2): highest, lowest timestep kept
    inside = (t <= window[:, 0]) & (t >= window[:, 1])  # (B,)
    kept = jnp.where(inside, cond["controlnet_conditioning_scale"], 0.0)  # (B,)
    return cond["control_residual_scales"] * kept[:, None]  # (B, K): diffusers' ramp * scale
