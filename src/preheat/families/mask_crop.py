"""Inpainting's ``padding_mask_crop``: repaint only the part of the image around the mask, at the
output size, and paste it back -- host side, with PIL, as diffusers' inpaint pipelines do, so the
pixels match theirs.

    step                                 diffusers (VaeImageProcessor)              here
    -----------------------------------  -----------------------------------------  ----------------
    mask -> a box around its non-black   get_crop_region(mask, width, height, pad)  ``crop_region``
      pixels, padded, grown to the
      output's aspect, clamped
    image, mask -> the output size       .crop(box), resize_mode="fill"              ``fill_resized``
    the output -> the image's size,      apply_overlay(mask, image, output, box)     ``overlay``
      pasted at the box, kept pixels
      through the mask

Nothing here is compiled: the crop is resized to the call's width x height, the size its
programs already take, so a crop is data like the image it comes from.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from preheat.errors import InvalidArgumentError

__all__ = ["CropRegion", "crop_region", "fill_resized", "overlay"]


class CropRegion(NamedTuple):
    """A box of the original image, in pixels (diffusers' ``crops_coords``: PIL's crop box)."""

    left: int
    top: int
    right: int
    bottom: int


def crop_region(mask_image: np.ndarray, width: int, height: int, pad: int) -> CropRegion:
    """The box diffusers' ``get_crop_region`` finds in a uint8 (H, W) mask for an output of
    width x height: every non-black pixel, ``pad`` more on each side, grown on its short side to
    the output's aspect ratio (centred, then shifted back inside the image and clamped)."""
    rows, cols = np.flatnonzero(mask_image.any(axis=1)), np.flatnonzero(mask_image.any(axis=0))
    if cols.size == 0:  # diffusers divides by a zero-height box here
        raise InvalidArgumentError("padding_mask_crop needs a mask with something to repaint; mask_image is all "
                                   "black", argument="padding_mask_crop")
    h, w = mask_image.shape
    left, top = max(int(cols[0]) - pad, 0), max(int(rows[0]) - pad, 0)
    right, bottom = min(int(cols[-1]) + 1 + pad, w), min(int(rows[-1]) + 1 + pad, h)
    aspect = width / height  # diffusers' float arithmetic, step for step, so the box is the same
    if (right - left) / (bottom - top) > aspect:
        grow = int((right - left) / aspect - (bottom - top))
        top, bottom = _grown(top, bottom, grow, h)
    else:
        grow = int((bottom - top) * aspect - (right - left))
        left, right = _grown(left, right, grow, w)
    return CropRegion(left, top, right, bottom)


def _grown(low: int, high: int, grow: int, size: int) -> tuple[int, int]:
    """[low, high) grown by ``grow`` (half before, the rest after), moved back inside [0, size)
    and clamped to it."""
    low, high = low - grow // 2, high + grow - grow // 2
    if high >= size:
        low, high = low - (high - size), size
    if low < 0:
        low, high = 0, high - low
    return low, min(high, size)


def _fitted(image: Any, width: int, height: int, cover: bool) -> tuple[Any, int, int]:
    """``image`` resized (lanczos), its aspect kept, to fit inside width x height (``cover``: to
    cover it), and where it goes to be centred: (resized, x, y). diffusers' ``_resize_and_fill`` /
    ``_resize_and_crop``, integer division included."""
    from PIL import Image

    aspect, source = width / height, image.width / image.height
    full_width = aspect > source if cover else aspect < source  # else full height
    w = width if full_width else image.width * height // image.height
    h = image.height * width // image.width if full_width else height
    return image.resize((w, h), resample=Image.LANCZOS), width // 2 - w // 2, height // 2 - h // 2


def fill_resized(array: np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 (H, W[, 3]) -> (height, width[, 3]): diffusers' ``resize_mode="fill"``, fitted inside
    and centred, the uncovered sides filled by stretching the edge rows (or columns) out; black
    where a side is under one pixel."""
    from PIL import Image

    image = Image.fromarray(array)
    resized, x, y = _fitted(image, width, height, cover=False)
    out = Image.new(image.mode, (width, height))  # diffusers' canvas is RGB; a mask's values are the same in L
    out.paste(resized, box=(x, y))
    aspect, source = width / height, image.width / image.height
    if aspect < source and y > 0:  # full width: stretch the first and last rows over the bands left
        out.paste(resized.resize((width, y), box=(0, 0, width, 0)), box=(0, 0))
        out.paste(resized.resize((width, y), box=(0, resized.height, width, resized.height)),
                  box=(0, y + resized.height))
    elif aspect > source and x > 0:  # full height: the first and last columns
        out.paste(resized.resize((x, height), box=(0, 0, 0, height)), box=(0, 0))
        out.paste(resized.resize((x, height), box=(resized.width, 0, resized.width, height)),
                  box=(x + resized.width, 0))
    return np.asarray(out)


def overlay(generated: np.ndarray, image: np.ndarray, mask_image: np.ndarray, region: CropRegion) -> np.ndarray:
    """A cropped call's output, uint8 (height, width, 3), back in its image (H, W, 3): resized to
    cover the crop box (lanczos, centred), pasted there on black, then the image's own pixels laid
    over it through the inverted mask (black: the image's, white: the output's, grey: both) --
    diffusers' ``apply_overlay``, with the mask as given, not binarized."""
    from PIL import Image, ImageOps

    h, w = mask_image.shape
    kept = Image.new("RGBa", (w, h))  # premultiplied: a grey mask pixel blends the image's alpha too
    kept.paste(Image.fromarray(image).convert("RGBA").convert("RGBa"),
               mask=ImageOps.invert(Image.fromarray(mask_image)))
    left, top, right, bottom = region
    resized, x, y = _fitted(Image.fromarray(generated), right - left, bottom - top, cover=True)
    box = Image.new("RGB", (right - left, bottom - top))
    box.paste(resized, box=(x, y))
    out = Image.new("RGB", (w, h))
    out.paste(box, box=(left, top))
    out = out.convert("RGBA")
    out.alpha_composite(kept.convert("RGBA"))
    return np.asarray(out.convert("RGB"))
