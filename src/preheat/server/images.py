"""uint8 pixels -> encoded images and ``data:`` URLs (Cog returns files as data URLs when it has no upload URL)."""

from __future__ import annotations

import base64
import io

import numpy as np

__all__ = ["encode", "data_url", "MIME", "decode_data_url"]

MIME = {"png": "image/png", "webp": "image/webp", "jpg": "image/jpeg"}
_PIL_FORMAT = {"png": "PNG", "webp": "WEBP", "jpg": "JPEG"}


def encode(pixels: np.ndarray, fmt: str = "png") -> bytes:
    """One image, (H, W, C) uint8 with C in 1/3/4, as PNG / WebP (lossless) / JPEG bytes."""
    from PIL import Image

    if pixels.ndim != 3 or pixels.dtype != np.uint8:
        raise ValueError(f"expected (H, W, C) uint8 pixels, got {pixels.shape} {pixels.dtype}")
    c = pixels.shape[-1]
    if c == 1:
        image = Image.fromarray(pixels[..., 0], "L")
    elif c in (3, 4):
        image = Image.fromarray(pixels, "RGB" if c == 3 else "RGBA")
    else:
        raise ValueError(f"cannot encode {c}-channel pixels as an image")
    if fmt == "jpg" and image.mode == "RGBA":
        image = image.convert("RGB")
    buf = io.BytesIO()
    options = {"lossless": True} if fmt == "webp" else ({"quality": 95} if fmt == "jpg" else {})
    image.save(buf, format=_PIL_FORMAT[fmt], **options)
    return buf.getvalue()


def data_url(pixels: np.ndarray, fmt: str = "png") -> str:
    return f"data:{MIME[fmt]};base64,{base64.b64encode(encode(pixels, fmt)).decode('ascii')}"


def decode_data_url(url: str) -> np.ndarray:
    """The inverse of :func:`data_url` for lossless formats, as (H, W, C) uint8 (tests and bench)."""
    from PIL import Image

    header, _, payload = url.partition(",")
    if not header.startswith("data:") or not header.endswith(";base64"):
        raise ValueError("not a base64 data URL")
    image = Image.open(io.BytesIO(base64.b64decode(payload)))
    arr = np.asarray(image)
    return arr[..., None] if arr.ndim == 2 else arr
