"""The model code's per-platform choices: the UNets' and the VAE's 2-D convolution
(``PREHEAT_CONV``), GroupNorm's statistics (``PREHEAT_GROUPNORM``), how a plain fp8 1x1 Conv
applies its weight (``PREHEAT_FP8_1X1``) and whether the flash kernel's q/k/v are fenced from their
projection (``PREHEAT_FENCES``).

Why a switch: XLA:CPU's convolutions once ran well below its matrix products, so the same
convolution can be written as matrix products (per tap, or im2col) and measured against XLA's own
(``benchmarks/op_profile.py``; docs/benchmarks.md, issue 21). ``auto`` is the compile
target's platform's choice per layer (``preheat.platforms``): XLA's convolution on the CPU and on
a GPU that runs the program (what cuDNN wants), ``taps`` in a deviceless compile for a GPU
(``preheat warm --target``: XLA leaves a cuDNN convolution's algorithm unchosen there, and the H200
rejected such an executable at its first run, docs/gpu.md), and ``im2col`` on a TPU for the large
batches where libtpu's convolution crashed its compiler. An ``auto`` entry keys as ``auto`` like the
pod's own program: every input of the choice (the platform, the shapes, deviceless or not) is in
the key already. An explicit setting is part of the compile cache's key, so an executable traced
with one is never served for another.

GroupNorm: ``two_pass`` computes the mean, then the variance around it (a reduction per moment,
then the normalise pass); ``one_pass`` takes both moments in one reduction over the input, shifted
by the mean of each group's first position so that ``E[d^2] - E[d]^2`` does not cancel, and folds
the statistics with the affine weights into one multiply-add. ``auto`` is the platform's:
``one_pass`` on CPU, where the norms are memory-bound (measured 1.06-1.09x per built-in denoiser
call and 1.03-1.08x on the cifar architecture; docs/benchmarks.md, issue 21), and ``two_pass``
elsewhere, what XLA's GPU fusions were tuned for.

fp8 1x1 convs (``weights_dtype="float8_e4m3fn"``): ``gemm`` leaves a plain fp8 1x1 kernel fp8 in
``storage.upcast`` and ``layers.Conv2d`` applies it as a matrix product whose operand read converts
it (one GEMM on the fp8 weight); ``conv`` converts it in ``upcast`` like any other fp8 weight, and
the layer runs XLA's convolution (cuDNN on a GPU) on that bf16 copy. ``auto`` is ``gemm``. The
deviceless H200 HLO has one kernel per layer instead of two, but a whole UNet writes 0.2-0.8% more
bytes (split-K GEMMs at 16² and 8²; docs/benchmarks.md, "fp8three"): the GPU check's ``fp8unet``
row times both, autotuned, and decides which stays (docs/gpu.md).

Fences (``fence``): XLA:TPU fuses the transpose of q/k/v to heads-first, which the flash kernel
takes, into the projection that makes them, and the projection then writes its output at half the
matrix unit's rate (SDXL's UNet profiled on a v5e: 88-95 TFLOP/s against 178 for the same
projection writing tokens-first; docs/tpu.md). ``jax.lax.optimization_barrier`` on the projected
q/k/v makes the transpose a copy of its own (4.6 ms less a call). The values are the same; only the
fusion changes. (A fence on a GEGLU's product, the other operand XLA:TPU fused into a product, freed
the down projection but left the exact GELU a vector pass of its own: no faster, measured; not used.)
``auto`` is the platform's (``Platform.fences``: on a TPU only); ``on``/``off`` force it, for
measurement, and key like ``PREHEAT_CONV``.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, TypeVar

import jax
import jax.numpy as jnp

from preheat import platforms
from preheat.errors import InvalidArgumentError

__all__ = ["CONV_IMPLS", "GROUPNORM_IMPLS", "FP8_1X1_IMPLS", "FENCE_SETTINGS", "conv_impl", "conv2d",
           "groupnorm_impl", "fp8_1x1_impl", "fence"]

Array = jax.Array
T = TypeVar("T")

CONV_IMPLS = ("conv", "taps", "im2col", "dot1x1")
GROUPNORM_IMPLS = ("two_pass", "one_pass")
FP8_1X1_IMPLS = ("gemm", "conv")
FENCE_SETTINGS = ("on", "off")


def _setting(variable: str, choices: tuple[str, ...], auto: Callable[[], str]) -> str:
    """The implementation ``variable`` names, one of ``choices``; unset or ``auto``: ``auto()``."""
    impl = os.environ.get(variable, "auto")
    if impl == "auto":
        return auto()
    if impl not in choices:
        raise InvalidArgumentError(f"{variable}={impl!r}; supported: auto, {', '.join(choices)}", argument=variable)
    return impl


def conv_impl(layer: Optional[platforms.ConvLayer] = None) -> str:
    """The convolution implementation for ``layer`` (None: the platform's general choice) in programs
    traced now: ``PREHEAT_CONV`` if set, else (``auto``) the compile target's platform's (the module
    docstring says which, and why)."""
    return _setting("PREHEAT_CONV", CONV_IMPLS,
                    lambda: platforms.current().conv_form(layer, platforms.deviceless()))


def groupnorm_impl() -> str:
    """GroupNorm's statistics for programs traced now: ``PREHEAT_GROUPNORM`` if set, else per
    platform (``auto``): one pass on CPU, two passes elsewhere."""
    return _setting("PREHEAT_GROUPNORM", GROUPNORM_IMPLS, lambda: platforms.current().groupnorm_form())


def fp8_1x1_impl() -> str:
    """How a plain fp8 1x1 Conv applies its weight in programs traced now: ``PREHEAT_FP8_1X1`` if
    set, else ``gemm`` (``auto``): one GEMM reading the fp8 weight; ``conv``: XLA's convolution on a
    bf16 copy (``storage.upcast`` converts it). Read by ``storage._pointwise_conv``."""
    return _setting("PREHEAT_FP8_1X1", FP8_1X1_IMPLS, lambda: "gemm")


def fence(x: T) -> T:
    """``x`` (an array or a tuple of them) materialised before the matrix product that reads it,
    where the compile target's platform wants it (the module docstring); else ``x`` itself."""
    on = _setting("PREHEAT_FENCES", FENCE_SETTINGS, lambda: "on" if platforms.current().fences else "off")
    return jax.lax.optimization_barrier(x) if on == "on" else x


def conv2d(x: Array, kernel: Array, stride: int, padding: int, impl: str | None = None) -> Array:
    """(B, H, W, Cin) * (k, k, Cin, Cout) -> (B, H', W', Cout), symmetric integer padding.

    ``conv``: XLA's convolution. ``taps``: one matrix product per kernel tap (k*k products of
    shifted views, summed); ``im2col``: the taps side by side and one product; ``dot1x1``: XLA's
    convolution but a 1x1 one as a ``dot_general`` (every non-``conv`` choice does that). The
    matrix forms run XLA:CPU's dot path instead of its convolution path; they are the same sums in
    another order, so they agree with ``conv`` to float rounding."""
    k = kernel.shape[0]
    impl = impl or conv_impl(platforms.ConvLayer(x.shape[0], x.shape[1], x.shape[2], x.shape[3], kernel.shape[3], k,
                                                 stride))
    if k == 1 and stride == 1 and padding == 0 and impl != "conv":
        return jax.lax.dot_general(x, kernel[0, 0], (((3,), (0,)), ((), ())))  # (B, H, W, Cout)
    if impl in ("conv", "dot1x1"):
        return jax.lax.conv_general_dilated(
            x, kernel, window_strides=(stride, stride), padding=((padding, padding), (padding, padding)),
            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    if padding:
        x = jnp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    b, h, w, cin = x.shape
    ho, wo = (h - k) // stride + 1, (w - k) // stride + 1
    taps = [jax.lax.slice(x, (0, i, j, 0), (b, i + (ho - 1) * stride + 1, j + (wo - 1) * stride + 1, cin),
                          (1, stride, stride, 1)) for i in range(k) for j in range(k)]  # k*k x (B, H', W', Cin)
    if impl == "im2col":
        cols = jnp.concatenate(taps, axis=-1)  # (B, H', W', k*k*Cin), tap-major like the HWIO kernel
        return jax.lax.dot_general(cols, kernel.reshape(k * k * cin, -1), (((3,), (0,)), ((), ())))
    y = None
    for n, tap in enumerate(taps):
        part = jax.lax.dot_general(tap, kernel[n // k, n % k], (((3,), (0,)), ((), ())))  # (B, H', W', Cout)
        y = part if y is None else y + part
    return y
