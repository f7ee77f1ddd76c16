"""int8 weight storage (``weights_dtype="int8"``) done independently, in torch, on diffusers' model:
the same rule as ``preheat.models.quantised.quantise_int8`` (symmetric, one scale per output
channel, ``scale = max|w| * (1 / 127)``, ``q = round(w * (1 / scale))`` half to even), written again here
from its definition,
so that preheat's int8 image is checked against diffusers' pipeline computing with those weights
(tests/models/test_int8.py)."""

from __future__ import annotations

from typing import Any

INT8 = "int8"
MEAN_TOL = 2.0  # mean |pixel difference| <= 2 levels of 255 (issue 59's bar for 8-bit images)


def quantise_dequantise(weight: Any, feature_axis: int = 0) -> Any:
    """``weight`` (torch, float32) quantised to int8 per output channel and back: torch's output
    channels are axis 0 of a Linear's ``(out, in)`` and a Conv's ``(out, in, kh, kw)``; an
    Embedding's ``(n, dim)`` is scaled per feature (``feature_axis=1``), as preheat scales the last
    axis of its ``(n, dim)`` table."""
    import numpy as np
    import torch

    w = weight.detach().to(torch.float32)
    dims = [d for d in range(w.ndim) if d != feature_axis]
    scale = w.abs().amax(dim=dims, keepdim=True) * float(np.float32(1 / 127))  # 1/127 rounded to float32
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w * (1.0 / safe)), -127, 127)
    return (q * scale).to(weight.dtype)


def round_to_int8(denoiser: Any, names: set[str]) -> Any:
    """``denoiser`` (diffusers' transformer or UNet) with the weights of the modules ``names``
    quantised to int8 and back, in place (biases untouched: preheat keeps them full, as for fp8)."""
    import torch

    modules = dict(denoiser.named_modules())
    with torch.no_grad():
        for name in names:
            module = modules[name]
            axis = 1 if isinstance(module, torch.nn.Embedding) else 0
            module.weight.copy_(quantise_dequantise(module.weight, axis))
    return denoiser


def stored_int8(params: Any) -> set[str]:
    """Module names (torch style) of the weights a pipeline holds as int8 (``Quantised`` values)."""
    import numpy as np
    from flax import nnx

    from preheat.models.quantised import Quantised

    return {".".join(str(p) for p in path[:-1]) for path, var in nnx.to_flat_state(params)
            if isinstance(var.get_value(), Quantised) and np.dtype(var.get_value().dtype) == np.int8}
