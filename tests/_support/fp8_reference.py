"""fp8 weight storage (``weights_dtype="float8_e4m3fn"``) against diffusers' layerwise casting: the
reference denoiser, the layers each side stores in fp8, and the image comparison the fp8 parity
tests share (tests/models/test_storage.py's FLUX.1, SD 1.x, SD 2.x, SDXL and SD3,
tests/families/test_fill.py's Fill, tests/families/test_kontext.py's Kontext).

preheat keeps a cast layer's bias in the compute dtype, where ``enable_layerwise_casting`` stores
it in fp8 too: :func:`round_to_fp8` makes either reference by hand (weights only: preheat's values;
with the biases: diffusers' layerwise image, bit for bit on the tiny folders)."""

from __future__ import annotations

from typing import Any

import numpy as np
from tests._support.numerics import mean_abs_px, px_diff

FP8 = "float8_e4m3fn"
MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255


def cast_layerwise(denoiser: Any) -> Any:
    """``denoiser`` (diffusers' transformer or UNet) under ``enable_layerwise_casting``: fp8 storage,
    float32 compute."""
    import torch

    denoiser.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    return denoiser


def round_to_fp8(denoiser: Any, names: set[str], biases: bool = False) -> Any:
    """``denoiser`` (diffusers' transformer or UNet, float32) with the weights of the modules
    ``names`` rounded to fp8 and back, in place: the values preheat's fp8 storage computes with (it
    keeps biases in the compute dtype). ``biases=True``: their biases rounded too, as
    ``enable_layerwise_casting`` stores them (it casts whole modules)."""
    import torch

    modules = dict(denoiser.named_modules())
    with torch.no_grad():
        for name in names:
            for leaf in ("weight", "bias") if biases else ("weight",):
                value = getattr(modules[name], leaf, None)
                if value is not None:
                    value.copy_(value.to(torch.float8_e4m3fn).to(value.dtype))
    return denoiser


def cast_layers(denoiser: Any) -> set[str]:
    """Module names of the weights diffusers holds in fp8 (after :func:`cast_layerwise`)."""
    import torch

    return {n for n, m in denoiser.named_modules()
            if getattr(m, "weight", None) is not None and m.weight.dtype == torch.float8_e4m3fn}


def stored_low(params: Any) -> set[str]:
    """Module names (torch style) of the weights a pipeline holds in fp8."""
    from flax import nnx

    return {".".join(str(p) for p in path[:-1]) for path, var in nnx.to_flat_state(params)
            if np.dtype(var.get_value().dtype) == np.dtype(FP8)}


def assert_fp8_matches(ours: np.ndarray, theirs: np.ndarray, full: np.ndarray, what: str) -> float:
    """preheat's fp8 image ``ours`` within ``MEAN_TOL`` of diffusers' layerwise-cast ``theirs``, not
    flat, and moved from the full-precision image ``full`` by more than twice that gap (the storage
    really is fp8). Returns the mean |Δpx| to diffusers."""
    diff = px_diff(ours, theirs)
    print(f"{what} fp8: mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert diff.mean() <= MEAN_TOL and ours.std() > 5, (diff.mean(), ours.std())
    moved = mean_abs_px(full, ours)
    print(f"{what} fp8 vs full precision: mean |Δpx| {moved:.4f}")
    assert moved > 2 * diff.mean() and moved > 0.1, (moved, diff.mean())
    return float(diff.mean())
