"""The torch backend's image-conditioned calls: diffusers' own img2img and inpaint pipelines
(SD, SDXL, Flux and SD3; FLUX.1 Fill).

A call with ``image`` (and ``mask_image``) runs ``StableDiffusion[XL]Img2ImgPipeline`` or
``...InpaintPipeline``, built once from the loaded pipeline's components (``from_pipe``: no
weights copied). The same ε as the JAX engine: diffusers draws its own noise and hands it to the
scheduler's ``add_noise`` (the start, and an inpaint loop's blending); :func:`same_noise` makes
that call use preheat's ε instead -- at inpainting's strength 1 (``is_strength_max``) the ε is
passed as ``latents``, which diffusers then takes as the noise. What still differs: diffusers
samples the VAE posterior from its generator, the JAX engine from the seeds' keys.
``padding_mask_crop`` is diffusers' own keyword here (one per call, as its pipelines take it).
``StableDiffusion3InpaintPipeline`` decodes ``latents / scaling_factor``, without the VAE's
``shift_factor`` that every other SD3 pipeline adds (diffusers issue 13611, item 1): a last-step
callback adds it back, so both backends decode alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from preheat.backends.torch.calls import diffusers_calls
from preheat.families.inputs import IMAGE_SIZE

__all__ = ["image_pipeline", "image_kwargs", "same_noise", "pixels_of"]

def image_pipeline(pipe: Any, family: str, inpaint: bool, cache: dict) -> Any:
    """diffusers' img2img / inpaint pipeline sharing ``pipe``'s components (built once per kind)."""
    key = (family, inpaint)
    if key not in cache:
        import diffusers

        calls = diffusers_calls(family)
        name = calls.inpaint if inpaint else calls.img2img
        if name is None:
            from preheat.errors import InvalidArgumentError

            raise InvalidArgumentError(f"the torch backend has no {'inpainting' if inpaint else 'img2img'} pipeline "
                                       f"for a {family} model", argument="mask_image" if inpaint else "image")
        extra = {"requires_safety_checker": False} if calls.safety_checker else {}
        built = getattr(diffusers, name).from_pipe(pipe, **extra)
        built.set_progress_bar_config(disable=True)
        cache[key] = built
    out = cache[key]
    out.scheduler = pipe.scheduler  # this call's sampler
    return out


def image_kwargs(values: dict[str, Any], kwargs: dict[str, Any], family: str) -> dict[str, Any]:
    """A text-to-image call's keywords -> the image pipeline's: the image (and mask) as PIL, the
    strength; SD img2img takes no size (it is the image's; Flux and SD3 resize the image to
    width x height: ``DiffusersCalls.sized_image``) and no latents (its ε is drawn)."""
    from PIL import Image

    calls = diffusers_calls(family)
    out = dict(kwargs)
    given = out.pop("latents", None)  # as the text pipeline takes them (Flux: packed)
    out.update(image=Image.fromarray(values["image"]), strength=values["strength"])
    if calls.sized_image:  # the image once per prompt: SD3's img2img cannot spread one over a list of generators
        out["image"] = [out["image"]] * len(values["prompt"])
    if values.get("mask_image") is None:
        if not calls.sized_image:
            for key in IMAGE_SIZE:  # diffusers' size keywords are ours
                out.pop(key, None)
    else:
        out["mask_image"] = Image.fromarray(values["mask_image"])
        if values["strength"] == 1.0 and calls.strength_max_latents:  # is_strength_max: given latents are the noise
            out["latents"] = given
        if calls.inpaint_decode_shift:
            out.update(callback_on_step_end=_sd3_shift, callback_on_step_end_tensor_inputs=["latents"])
        pads = set(values.get("padding_mask_crop") or ())
        if len(pads) > 1:
            from preheat.errors import InvalidArgumentError

            raise InvalidArgumentError("the torch backend takes one padding_mask_crop per call (diffusers' "
                                       "pipelines crop once)", argument="padding_mask_crop")
        if pads:  # diffusers pastes the crop back into PIL outputs only, into one original image
            out.update(padding_mask_crop=pads.pop(), output_type="pil", image=Image.fromarray(values["image"]))
    return out


def _sd3_shift(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """At SD3 inpainting's last step: latents + shift_factor x scaling_factor, which its decode of
    ``latents / scaling_factor`` turns into the ``latents / scaling_factor + shift_factor`` of
    every other SD3 pipeline."""
    if i < pipe.num_timesteps - 1:
        return {}
    config = pipe.vae.config
    return {"latents": tensors["latents"] + config.shift_factor * config.scaling_factor}


def pixels_of(images: Any) -> np.ndarray:
    """A diffusers pipeline's images -> uint8 (n, H, W, 3): floats in [0, 1] rounded as its
    ``numpy_to_pil`` does, PIL images (a padding_mask_crop call's) as they are."""
    from PIL import Image

    if isinstance(images, list) and images and isinstance(images[0], Image.Image):
        return np.stack([np.asarray(image.convert("RGB")) for image in images])
    return (np.asarray(images, np.float32) * 255).round().astype(np.uint8)


def same_noise(scheduler: Any, eps: torch.Tensor) -> None:
    """Make ``scheduler.add_noise`` (flow schedulers: ``scale_noise``) use ``eps`` for the noise
    diffusers drew (same shape), so both backends noise the image alike; a scheduler made for this
    call only (``make_scheduler``)."""
    def ours(noise: torch.Tensor) -> torch.Tensor:
        if noise.ndim == 3 and eps.ndim == 4:  # FluxInpaintPipeline's loop blends with packed noise
            b, c, h, w = eps.shape
            packed = eps.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, c * 4)
            if tuple(noise.shape) == tuple(packed.shape):
                return packed.to(noise.device, noise.dtype)
        if tuple(noise.shape) != tuple(eps.shape):
            raise ValueError(f"diffusers' noise is {tuple(noise.shape)}, preheat's {tuple(eps.shape)}")
        return eps.to(noise.device, noise.dtype)

    if hasattr(scheduler, "scale_noise"):  # flow: scale_noise(sample, timestep, noise)
        scale_noise = scheduler.scale_noise
        scheduler.scale_noise = lambda sample, timestep, noise: scale_noise(sample, timestep, ours(noise))
    else:  # add_noise(original, noise, timesteps)
        add_noise = scheduler.add_noise
        scheduler.add_noise = lambda original, noise, timesteps: add_noise(original, ours(noise), timesteps)
