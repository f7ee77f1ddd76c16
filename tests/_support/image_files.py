"""Image files for the image-input tests: encoded pixels, data URIs, and the bad files a server
must refuse in one line (a decompression bomb's header, a truncated file, another format)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np


def encoded(pixels: np.ndarray, fmt: str = "PNG", mode: str | None = None) -> bytes:
    """uint8 pixels (H, W[, C]) as a file of ``fmt`` (PNG, JPEG, WEBP, GIF, BMP ...)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format=fmt)
    return buf.getvalue()


def png(pixels: np.ndarray) -> bytes:
    return encoded(pixels, "PNG")


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def bomb_png(width: int = 50_000, height: int = 50_000) -> bytes:
    """A few hundred bytes whose header declares width x height pixels (what a decompression
    bomb looks like before decoding: an IHDR, one small IDAT, IEND)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1024)) + chunk(b"IEND", b"")


def truncated(data: bytes) -> bytes:
    """The file cut short: its header intact, its pixel data not."""
    return data[: len(data) * 2 // 3]
