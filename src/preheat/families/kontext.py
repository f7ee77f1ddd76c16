"""FLUX.1 Kontext: diffusers' ``FluxKontextPipeline`` folders, a Flux model that edits a reference image.

The folder holds exactly a FLUX.1 folder's parts (``families.flux`` loads them); what differs is
one input and where it goes:

    stage         program                                                  one executable per
    ------------  -------------------------------------------------------  ---------------------
    encode        the Flux text encoders (``families.flux``)               batch
    encode_image  the reference (1, H', W', 3) uint8 -> VAE posterior mode  reference size
                  -> (1, h', w', C) latents (``text.encode_image``)
    denoise       Flux's loop; the reference's packed tokens sit after the  sampler, batch, size,
                  noise tokens in the sequence, ids [1, row, col] (noise:   reference size
                  [0, row, col]); the velocity of the noise tokens only
    decode        the VAE, as Flux                                          batch, size

As ``FluxKontextPipeline``: the reference is snapped to the nearest (by aspect ratio) of
Kontext's preferred resolutions (``image_resize="preferred"``, the default) or kept at its own
size (``"none"``), rounded down to the latent packing's multiple (16 px for an 8x VAE), and
resized with Lanczos; ``mu`` counts the noise tokens only. The output is the reference's size
unless ``width``/``height`` are given: then exactly those (diffusers would refit them to
``max_area``). The preferred resolutions are also the sizes a server and warm-up offer by default
(:meth:`FluxKontextFamily.served_sizes`). The image's content is data; its resized size is static.
True CFG (a negative prompt with ``true_cfg_scale`` > 1) is Flux's, the reference in both branches.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from preheat.errors import InvalidArgumentError
from preheat.families import image as image_input
from preheat.families.base import Conditioning, EngineView, Request
from preheat.families.flux import MAX_SEQUENCE_LENGTH, PROMPT_2, TRUE_CFG_SPECS, FluxFamily, load_flux
from preheat.families.image import IMAGE
from preheat.families.inputs import Choice, InputSpec
from preheat.families.stages import Staged, joined
from preheat.families.text import PROMPT

__all__ = ["FluxKontextFamily", "KONTEXT", "PREFERRED_KONTEXT_RESOLUTIONS", "reference_size", "load_flux_kontext"]

# (width, height): the resolutions FLUX.1 Kontext was trained on (diffusers' PREFERRED_KONTEXT_RESOLUTIONS)
PREFERRED_KONTEXT_RESOLUTIONS: tuple[tuple[int, int], ...] = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672))

REFERENCE = dataclasses.replace(IMAGE, description="The reference image to edit.", required=True)
IMAGE_RESIZE = InputSpec("image_resize", Choice(("preferred", "none")),
                         "preferred: snap the reference to the nearest of Kontext's trained resolutions; none: keep "
                         "its size (rounded down to the latent grid).", default="preferred")


def reference_size(width: int, height: int, mode: str, multiple: int) -> tuple[int, int]:
    """The (width, height) a reference of ``width`` x ``height`` is resized to, as
    ``FluxKontextPipeline.__call__`` computes it (its image processor's multiple is the packing's)."""
    w, h = width - width % multiple, height - height % multiple  # VaeImageProcessor.get_default_height_width
    if w <= 0 or h <= 0:
        raise InvalidArgumentError(f"image is {width}x{height}; a reference must be at least {multiple}x{multiple}",
                                   argument="image")
    if mode == "preferred":
        aspect = w / h
        _, w, h = min((abs(aspect - pw / ph), pw, ph) for pw, ph in PREFERRED_KONTEXT_RESOLUTIONS)
    return w // multiple * multiple, h // multiple * multiple


@dataclass(frozen=True)
class FluxKontextFamily(FluxFamily):
    name: str = "flux-kontext"
    specs: tuple[InputSpec, ...] = (PROMPT, PROMPT_2, *TRUE_CFG_SPECS, MAX_SEQUENCE_LENGTH, REFERENCE, IMAGE_RESIZE)

    def input_specs(self, pipe: EngineView) -> tuple[InputSpec, ...]:
        """Width and height default to the reference's size (not the native size)."""
        return tuple(dataclasses.replace(s, default=None, default_doc="the reference image's size")
                     if s.name in ("width", "height") else s for s in super().input_specs(pipe))

    def served_sizes(self, pipe: EngineView) -> tuple[tuple[int, int], ...]:
        multiple, high, _ = self.size_rule(pipe)
        return tuple((w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS
                     if w % multiple == 0 and h % multiple == 0 and max(w, h) <= high)

    def warm_inputs(self, pipe: EngineView, guided: bool) -> list[dict[str, Any]]:
        """A mid-grey reference of the native size (a surface warming another size passes its own)."""
        width, height = self.native_size(pipe)
        grey = np.full((height, width, 3), 128, np.uint8)
        return [{**v, "image": grey} for v in super().warm_inputs(pipe, guided)]

    def check_inputs(self, pipe: EngineView, n: int, inputs: dict[str, Any]) -> dict[str, Any]:
        if inputs.get("mask_image") is not None:
            raise InvalidArgumentError("mask_image: a FLUX.1 Kontext model edits the whole reference image and "
                                       "takes no mask", argument="mask_image")
        if inputs.get("image") is None:
            raise InvalidArgumentError("image is required: a FLUX.1 Kontext model edits a reference image",
                                       argument="image")
        return super().check_inputs(pipe, n, inputs)

    def check_images(self, pipe: EngineView, values: dict[str, Any], inputs: dict[str, Any]) -> None:
        """The reference's resized size (``reference_size``); the output's unless width/height are given."""
        image = values["image"]  # uint8 (H, W, 3), as given
        size = reference_size(image.shape[1], image.shape[0], values["image_resize"], pipe.components.size_multiple)
        values["reference_size"] = size
        if values["width"] is None:
            values["width"] = size[0]
        if values["height"] is None:
            values["height"] = size[1]

    def check_start(self, pipe: EngineView, request: Request) -> int | None:
        return None  # from noise: no strength

    def image_start(self, pipe: EngineView, request: Request, plan: Any) -> Staged:
        return Staged.ready(None)  # the loop starts from noise; the reference is conditioning

    def condition(self, pipe: EngineView, request: Request) -> Staged:
        x = image_input.pixels(request.values["image"], *request.values["reference_size"])  # (H', W', 3), Lanczos
        reference = Staged.of(image_input.encode_images(pipe, x[None], request.seeds[:1], 0, mode=True))

        def conditioning(c: Conditioning, latents: Any) -> Conditioning:  # latents (1, h', w', C)
            c.cond["image_latents"] = np.repeat(np.asarray(latents), request.n, axis=0)  # (n, h', w', C): one for all
            if request.guided:  # true CFG: the negative branch sees the same reference (FluxKontextPipeline)
                c.uncond["image_latents"] = c.cond["image_latents"]
            return c

        return joined([super().condition(pipe, request), reference], conditioning)

KONTEXT = FluxKontextFamily()

# A FluxKontextPipeline folder (FLUX.1 Kontext dev and fine-tunes of it): a FLUX.1 folder's parts
load_flux_kontext = functools.partial(load_flux, family=KONTEXT)
