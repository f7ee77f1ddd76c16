"""FLUX.1 Fill: diffusers' ``FluxFillPipeline`` folders, a Flux model trained to repaint a mask.

The folder holds a FLUX.1 folder's parts (``families.flux`` loads them); its transformer takes
more channels per token: the noise tokens' 4C, then the masked image's packed latents (4C) and
the mask at full resolution folded into the latent grid (4 s², s the VAE's factor): 384 for the
published model (64 + 64 + 256).

    stage         program                                                  one executable per
    ------------  -------------------------------------------------------  ---------------------
    encode        the Flux text encoders (``families.flux``)               batch
    encode_image  the image, and the image with the mask's region zeroed   batch, size
                  -> posterior samples -> (n, h, w, C) latents
    denoise       Flux's loop; each step's tokens are [noise tokens,        sampler, batch, size
                  packed (masked latents, mask)] along the channels
    decode        the VAE, as Flux                                          batch, size

As ``FluxFillPipeline``: the image is resized (Lanczos) to the output size and mapped to [-1, 1],
the mask binarized at 0.5 at that size (white = repaint); the masked image is ``image * (1 -
mask)``, encoded with a posterior sample (the noise stream's index 1, as an inpainting call's
masked image); the mask's (s, s) block under each latent pixel becomes its s² channels, in
diffusers' order. The loop starts at ``get_timesteps(strength)`` (default 1.0: from noise) from
the encoded image, as Flux img2img (``scale_noise``). The output is width x height, else the
model's native size; guidance (embedded) defaults to the pipeline's 30, steps to 50. The image's
and the mask's content and the strength are data; the size is static.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from preheat.families import image as image_input
from preheat.families.base import Conditioning, EngineView, Request
from preheat.families.flux import MAX_SEQUENCE_LENGTH, PROMPT_2, FluxFamily, load_flux
from preheat.families.image import IMAGE, MASK_IMAGE, STRENGTH
from preheat.families.inputs import WARM_IMAGE, InputSpec
from preheat.families.stages import Staged, joined
from preheat.families.text import PROMPT

__all__ = ["FluxFillFamily", "FILL", "mask_channels", "load_flux_fill"]

# both required: warm-up compiles the one variant (an image and its mask) at every served size
FILL_IMAGE = dataclasses.replace(IMAGE, description="The image to repaint where the mask is white.", required=True,
                                 warm=(WARM_IMAGE,))
FILL_MASK = dataclasses.replace(MASK_IMAGE, required=True, warm=(WARM_IMAGE,))
FILL_STRENGTH = dataclasses.replace(STRENGTH, default_doc="1.0, FluxFillPipeline's: from noise")


def mask_channels(mask: np.ndarray, scale: int) -> np.ndarray:
    """(n, H, W) {0, 1} mask -> (n, H/s, W/s, s²): each latent pixel's (s, s) block of the mask as
    its channels, channel i*s + j for block row i and column j (``FluxFillPipeline``'s view and
    permute of the full-resolution mask)."""
    n, height, width = mask.shape
    h, w = height // scale, width // scale
    blocks = mask.reshape(n, h, scale, w, scale)  # (n, h, i, w, j)
    return np.ascontiguousarray(blocks.transpose(0, 1, 3, 2, 4).reshape(n, h, w, scale * scale))


@dataclass(frozen=True)
class FluxFillFamily(FluxFamily):
    name: str = "flux-fill"
    defaults: Mapping[str, Any] = field(default_factory=lambda: {"sampler": "flow_euler", "steps": 50,
                                                                  "guidance": 30.0})
    # no padding_mask_crop; FluxFillPipeline takes no true_cfg_scale either
    specs: tuple[InputSpec, ...] = (PROMPT, PROMPT_2, MAX_SEQUENCE_LENGTH, FILL_IMAGE, FILL_MASK, FILL_STRENGTH)

    def condition_channels(self, latent_channels: int, vae_scale: int) -> int:
        """The masked image's latents and the mask's s² channels, per latent pixel (before packing)."""
        return latent_channels + vae_scale * vae_scale

    def model_defaults(self, guidance_embeds: bool) -> dict[str, Any]:
        return {"steps": 50, "guidance": 30.0}  # FluxFillPipeline's and FLUX.1-Fill-dev's card

    def check_images(self, pipe: EngineView, values: dict[str, Any], inputs: dict[str, Any]) -> None:
        """Both images required and of one size; strength defaults to 1.0; the output is
        width x height, else the native size (an inpainting model's rule)."""
        image_input.check_image_inputs(pipe, values, inputs, inpaint_model=True, default_strength=(1.0, 1.0),
                                       max_size=self.max_size)

    def image_start(self, pipe: EngineView, request: Request, plan: Any) -> Staged:
        """The image noised at the start step, as Flux img2img: the mask rides in the tokens, not blended."""
        return image_input.img2img_start(pipe, request)

    def condition(self, pipe: EngineView, request: Request) -> Staged:
        images = image_input.inpaint_images(request.values, request.n)  # (n, H, W, 3) in [-1, 1], (n, H, W)
        masked = image_input.masked(images.pixels, images.mask)  # FluxFillPipeline: image * (1 - mask)
        folded = mask_channels(images.mask, pipe.components.vae_scale)  # (n, h, w, s²)

        def conditioning(c: Conditioning, latents: Any) -> Conditioning:  # latents (n, h, w, C)
            latents = np.asarray(latents)
            c.cond["fill"] = np.concatenate([latents, folded.astype(latents.dtype)], axis=-1)
            return c

        return joined([super().condition(pipe, request),
                       Staged.of(image_input.encode_images(pipe, masked, request.seeds, 1))], conditioning)

FILL = FluxFillFamily()

# A FluxFillPipeline folder (FLUX.1 Fill dev and fine-tunes of it): a FLUX.1 folder's parts
load_flux_fill = functools.partial(load_flux, family=FILL)
