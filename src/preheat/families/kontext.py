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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from preheat.errors import InvalidArgumentError
from preheat.families.base import Conditioning, EngineView, LoadedModel, Request
from preheat.families.flux import FluxFamily, load_flux
from preheat.families.inputs import Choice, Image, InputSpec
from preheat.families.text import encode_image

__all__ = ["FluxKontextFamily", "KONTEXT", "PREFERRED_KONTEXT_RESOLUTIONS", "reference_size", "load_flux_kontext"]

# (width, height): the resolutions FLUX.1 Kontext was trained on (diffusers' PREFERRED_KONTEXT_RESOLUTIONS)
PREFERRED_KONTEXT_RESOLUTIONS: tuple[tuple[int, int], ...] = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672))

IMAGE = InputSpec("image", Image(), "The reference image to edit (a path, PIL image or uint8 array; a URL on a server).",
                  required=True)
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


def resize(image: np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 (H, W, 3) -> (height, width, 3), with PIL's Lanczos as diffusers' image processor."""
    if image.shape[:2] == (height, width):
        return image
    from PIL import Image as PILImage

    return np.asarray(PILImage.fromarray(image).resize((width, height), resample=PILImage.LANCZOS))


@dataclass(frozen=True)
class FluxKontextFamily(FluxFamily):
    name: str = "flux-kontext"
    specs: tuple[InputSpec, ...] = (*FluxFamily().specs, IMAGE, IMAGE_RESIZE)

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
        values = super().check_inputs(pipe, n, inputs)
        image = values["image"]  # uint8 (H, W, 3)
        w, h = reference_size(image.shape[1], image.shape[0], values["image_resize"], pipe.components["size_multiple"])
        values["image"] = resize(image, w, h)
        if values["width"] is None:
            values["width"] = w
        if values["height"] is None:
            values["height"] = h
        return values

    def condition(self, pipe: EngineView, request: Request) -> Conditioning:
        conditioning = super().condition(pipe, request)
        latents = encode_image(pipe, request.values["image"][None])  # (1, h', w', C): one reference for all
        conditioning.cond["image_latents"] = np.repeat(latents, request.n, axis=0)  # (n, h', w', C)
        return conditioning


KONTEXT = FluxKontextFamily()


def load_flux_kontext(root: Any, *, scheduler: Any = None, dtype: Any = "float32", variant: str | None = None,
                      offload_encoders: bool = False) -> LoadedModel:
    """A ``FluxKontextPipeline`` folder (FLUX.1 Kontext dev and fine-tunes of it)."""
    return load_flux(root, scheduler=scheduler, dtype=dtype, variant=variant, offload_encoders=offload_encoders,
                     family=KONTEXT)
