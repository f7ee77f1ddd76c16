"""An image goes in: img2img and inpainting inputs, shared by the latent families.

What diffusers' img2img / inpaint pipelines do before their loop, host side unless marked::

    step                                     diffusers                            here
    ---------------------------------------  -----------------------------------  --------------------------
    output size (img2img)                    the image's, rounded down to a       the same (a static bucket,
                                             multiple of the VAE factor           like width/height)
    output size (inpainting)                 width/height, else the UNet's native the same
    image -> [-1, 1]                         VaeImageProcessor: PIL lanczos       ``pixels``
                                             resize when the size differs, /255,
                                             2x - 1
    mask -> {0, 1}                           mask processor: grayscale, resize,   ``mask``
                                             /255, binarize at 0.5
    mask -> latent grid                      F.interpolate nearest: pixel (s i,   ``latent_mask``
                                             s j)
    masked image                             image * (mask < 0.5)                 ``masked``
    padding_mask_crop (inpainting)           get_crop_region, crop, resize_mode   ``crop_regions``,
                                             "fill"; after decoding,              ``inpaint_images``,
                                             apply_overlay                        ``pasted_back``
                                                                                  (``mask_crop``)
    image -> latents (device)                vae.encode -> posterior sample ->    the ``encode_image`` stage
                                             scaling (and shift)                  (``encode_images``)
    start step                               get_timesteps(strength)              ``samplers.strength_start``
    start sample (device)                    scheduler.add_noise(latents, ε, t)   ``samplers.Start`` in the
                                                                                  denoising program

The ``encode_image`` stage is one program per (batch, image size): shared by every sampler,
strength, prompt and image content. Its posterior samples are each image's own (``noise``
stream 2, index 0 for the image, 1 for a masked image), as the denoising noise is.

``padding_mask_crop`` is data too: each image's crop of the image and mask is resized to the
call's width x height, the size its programs take, and the output goes back into the image on the
host. It is given per image, so each image of a batch (a server's batch of requests) may have its
own crop box.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import numpy as np

from preheat.errors import InvalidArgumentError
from preheat.families import mask_crop
from preheat.families.base import EngineView, StageSignature
from preheat.families.inputs import WARM_IMAGE, Float, Image, InputSpec, Int
from preheat.families.mask_crop import CropRegion
from preheat.families.stages import EncodeImageArgs, Stage, Staged

__all__ = ["IMAGE", "MASK_IMAGE", "STRENGTH", "PADDING_MASK_CROP", "Strength", "InpaintImages", "image_size",
           "check_image_inputs", "unit_pixels", "pixels", "mask", "crop_regions", "inpaint_images", "pasted_back",
           "latent_mask", "masked", "encode_images", "encode_image_program", "img2img_start", "flow_start"]


@dataclass(frozen=True)
class Strength(Float):
    """img2img's strength: a number in (0, 1] (0 would run no step)."""

    low: float | None = 0.0
    high: float | None = 1.0
    low_open: bool = True  # what the surfaces' validators read (pydantic's gt)

    def check(self, name: str, value: Any) -> float:
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise InvalidArgumentError.about("{0}={value!r} must be a number in (0, 1]", name, value=value) from None
        if isinstance(value, bool) or not np.isfinite(f) or not 0.0 < f <= 1.0:
            raise InvalidArgumentError.about("{0}={value!r} is outside (0, 1]", name, value=value)
        return f  # its schema: Float's, of these bounds


# the surfaces derive from these: Cog's ``image`` / ``mask`` fields, ``--image`` / ``--mask`` /
# ``--strength``; warm-up compiles each variant (no image, an image, an image and its mask) at every
# served size (``WARM_IMAGE``: a placeholder of that size); ``needs``: a mask needs its image
IMAGE = InputSpec("image", Image(), "The image to start from (img2img), or to repaint where the mask is white: an "
                  "http(s) URL or a data URI on a server, a path on the command line.", example=None,
                  warm=(None, WARM_IMAGE))
MASK_IMAGE = InputSpec("mask_image", Image(mask=True), "Inpainting: where to repaint (white) and keep (black); "
                       "the image's size.", field="mask", flag="--mask", needs=("image",), warm=(None, WARM_IMAGE))
STRENGTH = InputSpec("strength", Strength(), "How far from the image to go, in (0, 1]: the share of the steps "
                     "that run (1: from noise).", default_doc="the pipeline's own (SD 0.8, SDXL 0.3; inpainting "
                     "SD 1.0, SDXL 0.9999)", needs=("image",),
                     warm=(1.0,))  # any strength is one program (data); 1.0 runs a step at warm-up's steps=1
# not warmed: a crop is resized to the call's size, so it runs the programs an uncropped mask runs
PADDING_MASK_CROP = InputSpec("padding_mask_crop", Int(0), "Inpainting: repaint only a box around the mask, this "
                              "many pixels wider on each side (grown to the output's aspect), at width x height, "
                              "and paste it back; the output is the image's size. One for all or one per image.",
                              per_image=True, needs=("mask_image",), default_doc="no crop")


def image_size(image: np.ndarray, multiple: int) -> tuple[int, int]:
    """(width, height) of an img2img output: the image's own, rounded down to ``multiple`` as
    diffusers' ``get_default_height_width``."""
    h, w = image.shape[:2]
    width, height = w - w % multiple, h - h % multiple
    if width < multiple or height < multiple:
        raise InvalidArgumentError(f"image is {w}x{h}; it must be at least {multiple}x{multiple}", argument="image")
    return width, height


def check_image_inputs(pipe: EngineView, values: dict[str, Any], inputs: dict[str, Any], *, inpaint_model: bool,
                       default_strength: tuple[float, float], max_size: int) -> None:
    """Cross-input checks and the output size, in ``values``: a mask needs an image of its size,
    strength needs an image, an inpainting model needs both; img2img sizes from the image unless
    width/height are given. ``default_strength``: (img2img, inpainting), the pipelines' defaults."""
    image, mask_image, strength = values.get("image"), values.get("mask_image"), values.get("strength")
    if image is None:
        if inpaint_model:
            raise InvalidArgumentError.about("{0} is required: this is an inpainting model (give {0} and {1})",
                                             "image", "mask_image")
        for name in ("mask_image", "strength"):
            if values.get(name) is not None:
                raise InvalidArgumentError.about("{0} needs {1}", name, "image")
        return
    if mask_image is None and inpaint_model:
        raise InvalidArgumentError.about("{0} is required: this is an inpainting model", "mask_image")
    if mask_image is not None and mask_image.shape[:2] != image.shape[:2]:
        (mh, mw), (h, w) = mask_image.shape[:2], image.shape[:2]
        raise InvalidArgumentError.about("{0} is {mw}x{mh} but {1} is {w}x{h}; they must be the same size",
                                         "mask_image", "image", mw=mw, mh=mh, w=w, h=h)
    crop_regions(values)  # an all-black mask has no box to crop: refused before any device work
    if strength is None:
        values["strength"] = default_strength[0 if mask_image is None else 1]
    if mask_image is None and inputs.get("width") is None and inputs.get("height") is None:
        width, height = image_size(image, pipe.components.size_multiple)
        if max(width, height) > max_size:
            raise InvalidArgumentError(f"image is {width}x{height}; at most {max_size} a side for this model "
                                       "(give width/height to resize it)", argument="image")
        values["width"], values["height"] = width, height


def _resized(array: np.ndarray, width: int, height: int, region: CropRegion | None = None) -> np.ndarray:
    """PIL's lanczos resize when the size differs, as diffusers' ``VaeImageProcessor.resize``; with
    a ``region``, that box of the array fitted and filled (``resize_mode="fill"``), as diffusers
    preprocesses a padding_mask_crop call."""
    if region is not None:
        left, top, right, bottom = region
        return mask_crop.fill_resized(array[top:bottom, left:right], width, height)
    if array.shape[1] == width and array.shape[0] == height:
        return array
    from PIL import Image as PILImage

    return np.asarray(PILImage.fromarray(array).resize((width, height), resample=PILImage.LANCZOS))


def unit_pixels(image: np.ndarray, width: int, height: int, region: CropRegion | None = None) -> np.ndarray:
    """uint8 (H, W, 3) (or its ``region``) -> float32 (height, width, 3) in [0, 1]: resized, /255 (a
    ControlNet's control image stops here, as diffusers' ``control_image_processor``)."""
    return _resized(image, width, height, region).astype(np.float32) / 255.0


def pixels(image: np.ndarray, width: int, height: int, region: CropRegion | None = None) -> np.ndarray:
    """uint8 (H, W, 3) (or its ``region``) -> float32 (height, width, 3) in [-1, 1], as diffusers preprocesses."""
    return 2.0 * unit_pixels(image, width, height, region) - 1.0


def mask(mask_image: np.ndarray, width: int, height: int, region: CropRegion | None = None) -> np.ndarray:
    """uint8 (H, W) (or its ``region``) -> float32 (height, width) in {0, 1} (1 = repaint): resized,
    /255, binarized at 0.5."""
    m = _resized(mask_image, width, height, region).astype(np.float32) / 255.0
    return np.where(m < 0.5, 0.0, 1.0).astype(np.float32)


def crop_regions(values: Mapping[str, Any]) -> tuple[CropRegion, ...] | None:
    """Each image's padding_mask_crop box in the image (None: the call crops nothing). Images that
    share a padding share a box."""
    pads = values.get("padding_mask_crop")
    if pads is None:
        return None
    boxes = {pad: mask_crop.crop_region(values["mask_image"], values["width"], values["height"], pad)
             for pad in set(pads)}
    return tuple(boxes[pad] for pad in pads)


class InpaintImages(NamedTuple):
    """What each image of an inpainting call starts from, at the output size: its image and mask,
    or their crops (``padding_mask_crop``)."""

    pixels: np.ndarray  # (n, height, width, 3) float32 in [-1, 1]
    mask: np.ndarray  # (n, height, width) float32 in {0, 1}, 1 = repaint


def inpaint_images(values: Mapping[str, Any], n: int) -> InpaintImages:
    """The image and mask of a call with ``mask_image``, per image (each crop box prepared once)."""
    w, h = values["width"], values["height"]
    regions = crop_regions(values) or (None,) * n
    prepared = {region: (pixels(values["image"], w, h, region), mask(values["mask_image"], w, h, region))
                for region in set(regions)}
    return InpaintImages(pixels=np.stack([prepared[r][0] for r in regions]),
                         mask=np.stack([prepared[r][1] for r in regions]))


def pasted_back(images: np.ndarray, values: Mapping[str, Any]) -> np.ndarray:
    """A call's decoded uint8 (n, height, width, 3) -> with padding_mask_crop, each pasted back into
    the image through the mask (``mask_crop.overlay``): (n, H, W, 3), the image's size; else as is."""
    regions = crop_regions(values)
    if regions is None:
        return images
    image, mask_image = values["image"], values["mask_image"]
    return np.stack([mask_crop.overlay(out, image, mask_image, region) for out, region in zip(images, regions)])


def latent_mask(m: np.ndarray, scale: int) -> np.ndarray:
    """([n,] H, W) -> ([n,] H/s, W/s, 1): nearest as ``F.interpolate`` picks it, pixel (s i, s j)."""
    return np.ascontiguousarray(m[..., ::scale, ::scale, None])


def masked(x: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The image with the region to repaint zeroed (diffusers' ``image * (mask < 0.5)``); batched or not."""
    return x * (m < 0.5)[..., None].astype(np.float32)


def encode_image_program(vae: Any, mode: bool = False) -> Any:
    """``EncodeImageArgs``: (params, images (B, H, W, 3) in [-1, 1], seeds (B,), index []) -> latents
    (B, h, w, C) float32: a posterior sample per image from its seed, scaled (and shifted) as the pipelines do
    (``mode``: the posterior's mode instead, as FLUX.1 Kontext's ``sample_mode="argmax"``)."""
    import jax.numpy as jnp

    from preheat.noise import IMAGE_STREAM, image_keys, normal_per_image

    def program(args: EncodeImageArgs) -> Any:
        params, images, seeds, index = args.params, args.images, args.seeds, args.index
        if mode:
            return vae.images_to_latents(params, images.astype(jnp.float32))
        f = vae.downscale
        shape = (images.shape[1] // f, images.shape[2] // f, vae.latent_channels)
        draw = normal_per_image(image_keys(seeds), IMAGE_STREAM, index, shape)  # (B, h, w, C)
        return vae.images_to_latents(params, images.astype(jnp.float32), noise=draw)

    return program


def encode_images(pipe: EngineView, images: np.ndarray, seeds: np.ndarray, index: int,
                  mode: bool = False) -> Stage:
    """The ``encode_image`` stage: (B, H, W, 3) float32 in [-1, 1] -> (B, h, w, C) latents
    (``mode``: the posterior's mode, not a sample), described, not run."""
    vae = pipe.components.vae
    sig = StageSignature("encode_image", batch=int(images.shape[0]), shape=tuple(images.shape[1:3]),
                         dtype=str(vae.dtype), extra=(("mode", True),) if mode else ())
    fingerprint = {**pipe.components.decode_fingerprint, "kind": "vae-encode"}
    return Stage("encode_image", fingerprint, sig, lambda: encode_image_program(vae, mode),
                 EncodeImageArgs(params=vae.params, images=images.astype(np.float32), seeds=seeds,
                                 index=np.int32(index)))


def img2img_start(pipe: EngineView, request: Any, *, blend: bool = False, pure_at_max: bool = False) -> Staged:
    """Where an img2img call of a flow family begins (Flux, SD3; ``flow_start``): at
    ``get_timesteps(strength)``'s step, from the encoded image noised there (None: no image).

    ``blend``: a ``mask_image`` is blended after each step, as ``FluxInpaintPipeline`` and
    ``StableDiffusion3InpaintPipeline`` do with a base transformer: the image (each image's crop,
    with padding_mask_crop) is encoded whole, and the latent-grid mask (pixel (s i, s j) of the
    binarized mask) keeps the rest at the next step's level. ``pure_at_max``: at strength 1 the
    loop begins from the noise alone (SD3's ``is_strength_max``; Flux noises the image even then,
    which at sigma 1 is the noise too)."""
    values, n = request.values, request.n
    if values.get("image") is None:
        return Staged.ready(None)
    from preheat.samplers import Start

    index = flow_start(pipe, request, blend)
    keep = None
    if blend and values.get("mask_image") is not None:
        images = inpaint_images(values, n)
        x = images.pixels  # (n, H, W, 3)
        keep = latent_mask(images.mask, pipe.components.vae_scale)  # (n, h, w, 1), 1 = repaint
    else:
        x = np.repeat(pixels(values["image"], values["width"], values["height"])[None], n, axis=0)  # (n, H, W, 3)
    pure = keep is not None and pure_at_max and values["strength"] == 1.0
    return Staged.of(encode_images(pipe, x, request.seeds, 0),  # -> (n, h, w, C)
                     lambda x0: Start(index=np.int32(index), x0=np.asarray(x0), pure_noise=np.bool_(pure), keep=keep))


def flow_start(pipe: EngineView, request: Any, blend: bool = True) -> int | None:
    """The start step of a flow family's image call (None: from noise), or a one-line error: a
    strength that leaves no step, a sampler that cannot blend a mask (Heun: two model calls a step)."""
    values = request.values
    if values.get("image") is None:
        return None
    from preheat.samplers import BLEND_SOLVERS, make_spec, strength_start

    index = strength_start(request.steps, values["strength"], "flow")  # int(n - n s)
    if blend and values.get("mask_image") is not None and \
            make_spec(pipe.scheduler_config, request.sampler).solver not in BLEND_SOLVERS:
        raise InvalidArgumentError(f"sampler {request.sampler!r} cannot blend an inpainting mask on this model "
                                   "(diffusers blends after each scheduler step); use flow_euler",
                                   argument="sampler")
    return index
