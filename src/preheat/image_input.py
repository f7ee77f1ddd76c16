"""Images a call passes in (img2img's ``image``, inpainting's ``mask_image``, Kontext's reference):
one reader for every surface, so a bad file gets the same one-line error from Python, the CLI and
the server.

What it takes: a PIL image, a uint8 array (H, W), (H, W, 1), (H, W, 3) or (H, W, 4), a path, the
encoded bytes of a file, or a ``data:`` URI (what a server's client sends; http(s) URLs are
fetched by the server's guarded fetch first, ``preheat.server.fetch``, and arrive here as bytes).

What it guarantees, before any pixel is decoded:
- the format is PNG, JPEG or WebP (read from the file's header, never from its name);
- width x height is at most ``max_pixels`` (default 4096², :func:`set_max_pixels`), so a
  decompression bomb -- a small file that declares a huge image -- is refused from its header.
  PIL's own ``Image.MAX_IMAGE_PIXELS`` is set from the same number.
Then, as diffusers' ``load_image`` and image processors do: EXIF orientation is applied, and the
image becomes RGB (``convert("RGB")``: RGBA, LA, P and L included) or, for a mask, one channel
(``convert("L")``). A truncated file is refused.
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

import numpy as np

from preheat.errors import InvalidArgumentError

__all__ = ["MAX_IMAGE_PIXELS", "FORMATS", "read_image", "set_max_pixels", "max_pixels", "transparent_mask"]

MAX_IMAGE_PIXELS = 4096 * 4096
FORMATS = ("PNG", "JPEG", "WEBP")
_limit = {"pixels": MAX_IMAGE_PIXELS}


def set_max_pixels(pixels: int) -> None:
    """The process's limit on width x height (a server's ``--max-image-pixels``); PIL's
    decompression-bomb limit follows it."""
    from PIL import Image

    if isinstance(pixels, bool) or not isinstance(pixels, int) or pixels < 1:
        raise InvalidArgumentError(f"max image pixels {pixels!r} must be a positive int", argument="max_image_pixels")
    _limit["pixels"] = pixels
    Image.MAX_IMAGE_PIXELS = pixels


def max_pixels() -> int:
    """The limit :func:`read_image` applies (:func:`set_max_pixels`)."""
    return _limit["pixels"]


def read_image(value: Any, name: str = "image", *, mask: bool = False, limit: int | None = None) -> np.ndarray:
    """``value`` -> uint8 pixels: (H, W, 3) RGB, or (H, W) for a ``mask`` (white = repaint).
    Anything wrong is one ``InvalidArgumentError`` naming ``name``."""
    from PIL import Image

    limit = max_pixels() if limit is None else limit
    if isinstance(value, Image.Image):
        image = value
        _check_size(name, image.size, limit)
    elif isinstance(value, np.ndarray):
        image = _from_array(name, value, limit)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        image = _decode(name, bytes(value), limit)
    elif isinstance(value, str) and value.startswith("data:"):
        image = _decode(name, _data_uri(name, value), limit)
    elif isinstance(value, (str, Path)):
        path = Path(value)
        if str(value).startswith(("http://", "https://")):
            raise InvalidArgumentError.about("{0} is a URL; pass a path, bytes or an image (a server fetches URLs "
                                             "through its guarded fetch)", name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise InvalidArgumentError.about("{0} {path!r} does not exist", name, path=str(value)) from None
        except (IsADirectoryError, PermissionError, OSError) as exc:
            raise InvalidArgumentError.about("{0} {path!r} cannot be read: {why}", name, path=str(value),
                                             why=exc.strerror or exc) from None
        image = _decode(name, data, limit)
    else:
        raise InvalidArgumentError.about("{0} must be a PIL image, a uint8 (H, W[, C]) array, a path or image bytes, "
                                         "not {kind}", name, kind=type(value).__name__)
    return _normalise(name, image, mask)


def _check_size(name: str, size: tuple[int, int], limit: int) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise InvalidArgumentError.about("{0} is empty ({width}x{height})", name, width=width, height=height)
    if width * height > limit:
        raise InvalidArgumentError.about("{0} is {width}x{height} = {pixels} pixels; at most {limit} (--max-image-pixels)",
                                         name, width=width, height=height, pixels=width * height, limit=limit)


def _from_array(name: str, array: np.ndarray, limit: int) -> Any:
    from PIL import Image

    if array.dtype != np.uint8:
        raise InvalidArgumentError.about("{0} is a {dtype} array; pass uint8 pixels (H, W, C)", name, dtype=array.dtype)
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
        raise InvalidArgumentError.about("{0} has shape {shape}; expected (H, W), (H, W, 1), (H, W, 3) or (H, W, 4)", name,
                                         shape=array.shape)
    _check_size(name, (array.shape[1], array.shape[0]), limit)
    return Image.fromarray(np.ascontiguousarray(array))


def _data_uri(name: str, uri: str) -> bytes:
    header, comma, payload = uri.partition(",")
    if not comma or not header.endswith(";base64"):
        raise InvalidArgumentError.about("{0} is a data URI without base64 data (data:image/png;base64,...)", name)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgumentError.about("{0}'s data URI is not valid base64", name) from None


def _decode(name: str, data: bytes, limit: int) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except UnidentifiedImageError:
        raise InvalidArgumentError.about("{0} is not an image PIL can read; send PNG, JPEG or WebP", name) from None
    except Image.DecompressionBombError:
        raise InvalidArgumentError.about("{0} declares more than {limit} pixels (--max-image-pixels)", name,
                                         limit=limit) from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise InvalidArgumentError.about("{0} cannot be read: {exc}", name, exc=exc) from None
    if image.format not in FORMATS:
        raise InvalidArgumentError.about("{0} is {format}; send PNG, JPEG or WebP", name, format=image.format)
    _check_size(name, image.size, limit)  # before a single pixel is decoded
    try:
        image.load()
    except Image.DecompressionBombError:
        raise InvalidArgumentError.about("{0} declares more than {limit} pixels (--max-image-pixels)", name,
                                         limit=limit) from None
    except (OSError, SyntaxError, ValueError) as exc:  # "image file is truncated", a broken stream
        raise InvalidArgumentError.about("{0} is truncated or corrupt ({format}: {exc})", name, format=image.format,
                                             exc=exc) from None
    return image


def _normalise(name: str, image: Any, mask: bool) -> np.ndarray:
    from PIL import ImageOps

    try:
        image = ImageOps.exif_transpose(image)  # a phone's portrait JPEG is stored sideways
        return np.asarray(image.convert("L" if mask else "RGB"), dtype=np.uint8)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError.about("{0} cannot be converted to {mode}: {exc}", name, mode="L" if mask else "RGB",
                                         exc=exc) from None


def transparent_mask(data: bytes, name: str = "mask") -> np.ndarray | None:
    """OpenAI's mask convention (a PNG whose fully transparent pixels, alpha 0, are what to edit)
    -> preheat's: (H, W) uint8, 255 (white: repaint) where alpha is 0 and 0 (black: keep)
    elsewhere. None when the file has no transparency at all. The file passes the same checks as
    :func:`read_image` (format, pixel limit before decoding, truncation, EXIF orientation)."""
    from PIL import ImageOps

    image = ImageOps.exif_transpose(_decode(name, bytes(data), max_pixels()))
    if not image.has_transparency_data:
        return None
    alpha = np.asarray(image.convert("RGBA").getchannel("A"))  # (H, W)
    return np.where(alpha == 0, 255, 0).astype(np.uint8)
