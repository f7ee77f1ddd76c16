"""Scaled fp8 checkpoints: fp8 weights with a float32 scale each, as ComfyUI ships them.

A "scaled fp8" file (e.g. ComfyUI's FLUX.1 fp8-scaled files) stores a layer's weight ``X.weight``
as ``F8_E4M3`` beside a float32 scalar ``X.scale_weight``; the real weight is
``X.weight.astype(float32) * X.scale_weight`` (the scale is usually ``amax / 448``, so the fp8
range is used whole). ``X.scale_input`` (a scale for fp8 matmul inputs) and the top-level marker
tensor ``scaled_fp8`` may be present too; weight-only storage does not use them.

preheat keeps such a weight **scaled on the device** where the load stores that layer in fp8 (a
denoiser's fp8 layers without ``weights_dtype``; the layers ``weights_dtype="float8_e4m3fn"``
names with it): the fp8 bytes as they are, beside the float32 scale, one ``storage.Quantised``
that the compiled apply expands to ``fp8 * scale`` where it is used (``weights.fill``). Every
other scaled weight (a layer fp8 storage keeps at full precision; a bundle's text encoders and
VAE, whose programs do not upcast) is **dequantised on the host** as it is placed, one tensor at
a time: the fp8 bytes times the scale in float32, then the dtype the load places it in. Both are
the same float32 products, so both give the same weights.

    weight_scales(tensors)      {"X.weight": "X.scale_weight"} for every scaled weight
    ignored(key, tensors)       the scale and marker tensors, which match no parameter
    scale_of(tensors, s)        a weight's scale, float32 shape () (one per tensor, or one line)
    dequantise(tensors, w, s)   the real weight (float32, torch layout), for the host path
    with_scales(place)          a single-file placer that also places the scales beside their weights
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

__all__ = ["MARKER", "weight_scales", "ignored", "scale_of", "dequantise", "with_scales"]

MARKER = "scaled_fp8"  # ComfyUI's marker tensor (top level, or under model.diffusion_model.)
_SCALE, _INPUT = "scale_weight", "scale_input"


def _sibling(key: str, leaf: str) -> str:
    return f"{key.rpartition('.')[0]}.{leaf}"


def weight_scales(tensors: Mapping[str, Any]) -> dict[str, str]:
    """{weight key: its scale's key} for every ``X.scale_weight`` whose ``X.weight`` is present."""
    return {w: k for k in tensors if k.endswith("." + _SCALE) and (w := _sibling(k, "weight")) in tensors}


def ignored(key: str, tensors: Mapping[str, Any]) -> bool:
    """The marker, and a scale (weight or input) whose weight is present: no parameter takes them."""
    if key == MARKER or key.endswith("." + MARKER):
        return True
    return key.endswith(("." + _SCALE, "." + _INPUT)) and _sibling(key, "weight") in tensors


def scale_of(tensors: Mapping[str, Any], scale_key: str) -> np.ndarray:
    """A weight's per-tensor scale as a float32 scalar (shape ()); a scale of more than one
    element is a one-line error (checked from the header where ``tensors`` has one)."""
    meta = tensors.meta(scale_key) if hasattr(tensors, "meta") else None
    shape = meta[0] if meta is not None else np.shape(tensors[scale_key])
    if int(np.prod(shape, dtype=np.int64)) != 1:
        from preheat.errors import ModelFormatError

        raise ModelFormatError(f"{scale_key} has shape {tuple(shape)}; a scaled fp8 file holds one scale per weight")
    return np.asarray(tensors[scale_key], np.float32).reshape(())


def dequantise(tensors: Mapping[str, Any], key: str, scale_key: str) -> np.ndarray:
    """``tensors[key]`` times its per-tensor scale, in float32 (torch layout)."""
    return np.asarray(tensors[key]).astype(np.float32) * scale_of(tensors, scale_key)


def with_scales(place: Callable[[str], Any]) -> Callable[[str], Any]:
    """A single-file placer (``single_file.Placer``) that also takes a scaled fp8 file's extra
    tensors: ``X.scale_weight`` goes beside every piece ``X.weight`` goes to (a fused weight's one
    scale serves each of its pieces), ``X.scale_input`` and the marker are dropped."""

    def placed(key: str) -> Any:
        if key == MARKER or key.endswith("." + MARKER) or key.endswith("." + _INPUT):
            return []
        if not key.endswith("." + _SCALE):
            return place(key)
        pieces = place(_sibling(key, "weight"))
        if not pieces:
            return pieces
        return [p._replace(name=_sibling(p.name, _SCALE), take=None, rows=None) for p in pieces]

    return placed
