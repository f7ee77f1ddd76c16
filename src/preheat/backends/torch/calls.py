"""How diffusers' pipelines of each family are called, where they differ: the torch backend's one
table of per-family knowledge (``DIFFUSERS_CALLS``), so that its call sites read a named field
instead of testing a family's name.

The JAX engine needs none of this: a family declares its inputs once (``preheat.families``), and
these fields only translate that call into diffusers' keywords and classes.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from preheat.errors import InvalidArgumentError

__all__ = ["DiffusersCalls", "DIFFUSERS_CALLS", "diffusers_calls", "size_ids"]


class DiffusersCalls(NamedTuple):
    """One family's diffusers calls."""

    # FluxPipeline's: the latents packed into 2x2 tokens, ``guidance_scale`` the model's embedded
    # scale (and ``true_cfg_scale`` CFG's, with ``prompt_2`` / the negatives), rather than CFG's scale
    packed_latents: bool = False
    img2img: Optional[str] = None  # the img2img pipeline class (None: the backend has none)
    inpaint: Optional[str] = None  # the inpainting pipeline class
    # its img2img takes width x height (and resizes the image to them) and one image per prompt,
    # rather than the image's own size
    sized_image: bool = False
    # inpainting at strength 1 (``is_strength_max``) takes given latents as its noise; FluxInpaintPipeline
    # noises the image at sigma 1 instead (``same_noise``'s ε)
    strength_max_latents: bool = True
    # StableDiffusion3InpaintPipeline decodes without the VAE's shift_factor (diffusers issue 13611)
    inpaint_decode_shift: bool = False
    safety_checker: bool = False  # its image pipelines take ``requires_safety_checker`` (SD 1.x/2.x)
    # its ControlNet pipeline classes (text-to-image, img2img, inpaint), for a model loaded with controlnet=
    controlnet: Optional[tuple[str, str, str]] = None


DIFFUSERS_CALLS: dict[str, DiffusersCalls] = {
    "stable-diffusion": DiffusersCalls(img2img="StableDiffusionImg2ImgPipeline",
                                       inpaint="StableDiffusionInpaintPipeline", safety_checker=True,
                                       controlnet=("StableDiffusionControlNetPipeline",
                                                   "StableDiffusionControlNetImg2ImgPipeline",
                                                   "StableDiffusionControlNetInpaintPipeline")),
    "stable-diffusion-xl": DiffusersCalls(img2img="StableDiffusionXLImg2ImgPipeline",
                                          inpaint="StableDiffusionXLInpaintPipeline",
                                          controlnet=("StableDiffusionXLControlNetPipeline",
                                                      "StableDiffusionXLControlNetImg2ImgPipeline",
                                                      "StableDiffusionXLControlNetInpaintPipeline")),
    "stable-diffusion-xl-refiner": DiffusersCalls(img2img="StableDiffusionXLImg2ImgPipeline",
                                                  inpaint="StableDiffusionXLInpaintPipeline"),
    "stable-diffusion-3": DiffusersCalls(img2img="StableDiffusion3Img2ImgPipeline",
                                         inpaint="StableDiffusion3InpaintPipeline", sized_image=True,
                                         inpaint_decode_shift=True),
    "flux": DiffusersCalls(packed_latents=True, img2img="FluxImg2ImgPipeline", inpaint="FluxInpaintPipeline",
                           sized_image=True, strength_max_latents=False),
    "flux-kontext": DiffusersCalls(packed_latents=True),  # FluxKontextPipeline takes its reference itself
    "flux-fill": DiffusersCalls(packed_latents=True, inpaint="FluxFillPipeline", sized_image=True),  # its own pipeline
}


def diffusers_calls(family: str) -> DiffusersCalls:
    """``family``'s row, or a one-line error: the torch backend does not run it."""
    try:
        return DIFFUSERS_CALLS[family]
    except KeyError:
        raise InvalidArgumentError(f"the torch backend does not run a {family} model") from None


def size_ids(v: dict[str, Any], key: str, negative_key: str) -> dict[str, Any]:
    """The family's SDXL time ids (``v[key]``, ``v[negative_key]``) as diffusers' size keywords:
    6 ids are (original size, crop, target size); a refiner's 5 end in its aesthetic score."""
    kwargs: dict[str, Any] = {}
    for name, prefix in ((key, ""), (negative_key, "negative_")):
        if v.get(name) is not None:
            ids = [float(x) for x in v[name]]
            kwargs.update({f"{prefix}original_size": tuple(map(int, ids[0:2])),
                           f"{prefix}crops_coords_top_left": tuple(map(int, ids[2:4]))})
            if len(ids) == 5:
                kwargs[f"{prefix}aesthetic_score"] = ids[4]
            else:
                kwargs[f"{prefix}target_size"] = tuple(map(int, ids[4:6]))
    return kwargs
