"""Scaled fp8 checkpoints: fp8 weights with a float32 scale each, as ComfyUI ships them.

A "scaled fp8" file (e.g. ComfyUI's FLUX.1 fp8-scaled files) stores a layer's weight ``X.weight``
as ``F8_E4M3`` beside a float32 scalar ``X.scale_weight``; the real weight is
``X.weight.astype(float32) * X.scale_weight`` (the scale is usually ``amax / 448``, so the fp8
range is used whole). ``X.scale_input`` (a scale for fp8 matmul inputs) and the top-level marker
tensor ``scaled_fp8`` may be present too; weight-only storage does not use them.

preheat keeps such a weight **scaled on the device** where the load stores that layer in fp8 (a
denoiser's fp8 layers without ``weights_dtype``; the layers ``weights_dtype="float8_e4m3fn"``
names with it): the fp8 bytes as they are, beside the float32 scale, one ``quantised.Quantised``
that the compiled apply uses where it is (``weights.fill``): a Linear or 1x1 conv scales its
product, ``(x @ fp8) * scale`` (``Quantised.product``, so a GPU's GEMM reads the fp8 weight itself),
any other layer expands ``fp8 * scale``. Every other scaled weight (a layer fp8 storage keeps at full
precision; a bundle's text encoders and VAE, whose programs do not upcast) is **dequantised on the
host** as it is placed, one tensor at a time: the fp8 bytes times the scale in float32, then the
dtype the load places it in. Both are the same products, to float32 rounding order.

    weight_scales(tensors)      {"X.weight": "X.scale_weight"} for every scaled weight
    ignored(key, tensors)       the scale and marker tensors, which match no parameter
    scale_of(tensors, w, s)     a weight's scale: float32 () per tensor, or per block as stored
    dequantise(tensors, w, s)   the real weight (float32, torch layout), for the host path
    with_scales(place)          a single-file placer that also places the scales beside their weights
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from preheat.models.quantised import Quantised

__all__ = ["MARKER", "weight_scales", "ignored", "scale_shape", "scale_of", "dequantise", "with_scales"]

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


def _shape(tensors: Mapping[str, Any], key: str) -> tuple[int, ...]:
    meta = tensors.meta(key) if hasattr(tensors, "meta") else None  # a Checkpoint: from its header
    return tuple(meta[0]) if meta is not None else tuple(np.shape(tensors[key]))


def scale_shape(tensors: Mapping[str, Any], key: str, scale_key: str) -> tuple[int, ...]:
    """The shape ``scale_of`` gives (torch layout): () for one scale per tensor, else the scale's
    own (blocks: the weight's rank, each axis dividing the weight's). Any other shape is a
    one-line error, found from the headers before a tensor is read."""
    weight, scale = _shape(tensors, key), _shape(tensors, scale_key)
    if int(np.prod(scale, dtype=np.int64)) == 1:
        return ()
    if len(scale) != len(weight) or any(m == 0 or n % m for n, m in zip(weight, scale)):
        from preheat.errors import ModelFormatError

        raise ModelFormatError(f"{scale_key} has shape {scale}; a scale is one per weight {key} {weight}, or one "
                               f"per block of it (the weight's rank, each axis dividing the weight's)")
    return scale


def scale_of(tensors: Mapping[str, Any], key: str, scale_key: str) -> np.ndarray:
    """``key``'s scale (torch layout): one per tensor as a float32 scalar, or one per block as
    stored (a GGUF Q8_0 weight's float16 scales, ``preheat.models.gguf_file``)."""
    shape = scale_shape(tensors, key, scale_key)
    scale = np.asarray(tensors[scale_key])
    return scale.astype(np.float32).reshape(()) if shape == () else scale


def dequantise(tensors: Mapping[str, Any], key: str, scale_key: str) -> np.ndarray:
    """``tensors[key]`` times its scale, in float32 (torch layout): ``quantised.Quantised``'s
    arithmetic, on the host."""
    return np.asarray(Quantised(np.asarray(tensors[key]), scale_of(tensors, key, scale_key)).expand(np.float32))


def _rows_of(take: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """A weight piece's cut, applied to its scale: a per-tensor scale (one element) serves every
    piece as it is; per-block scales have the weight's rows, so take the same rows."""
    if take is None:
        return None
    return lambda scale: scale if np.size(scale) == 1 else take(scale)


def with_scales(place: Callable[[str], Any]) -> Callable[[str], Any]:
    """A single-file placer (``single_file.Placer``) that also takes a scaled fp8 file's extra
    tensors: ``X.scale_weight`` goes beside every piece ``X.weight`` goes to (a fused weight's one
    scale serves each of its pieces; per-block scales are cut as the weight's rows are),
    ``X.scale_input`` and the marker are dropped."""

    def placed(key: str) -> Any:
        if key == MARKER or key.endswith("." + MARKER) or key.endswith("." + _INPUT):
            return []
        if not key.endswith("." + _SCALE):
            return place(key)
        pieces = place(_sibling(key, "weight"))
        if not pieces:
            return pieces
        return [p._replace(name=_sibling(p.name, _SCALE), take=_rows_of(p.take), rows=None) for p in pieces]

    return placed
