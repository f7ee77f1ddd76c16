"""Weights kept on the device in a compact form: fp8, and values with scales (``Quantised``).

Below ``weights`` (which places them) and ``storage`` (which chooses fp8 layers and upcasts them
inside the jitted apply), so both read one definition:

    FLOAT8        the fp8 storage dtype (float8_e4m3fn)
    INT8          int8 storage: values and one float32 scale per output channel, made at load
                  (``quantise_int8``), applied to the product's output like a scaled fp8 file's
    is_low(dtype) a storage dtype that the apply converts (fp8)
    Quantised     stored values and their scale: expanded to ``values * scale`` at use, or, where
                  the scale is per tensor or per output channel, applied to a matmul's output
                  (``product``; a 1x1 convolution's weight through ``matrix``), so that the
                  GEMM reads the stored values itself
    Packed        GGML blocks (GGUF Q4_0 ... Q6_K, IQ4_NL, IQ4_XS) kept as their bytes, unpacked at use
                  (``preheat.models.ggml``)
    holds(dtype)  whether the default device holds such weights (probed once)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from preheat.models.ggml import LAYOUTS, dequantise

__all__ = ["FLOAT8", "INT8", "quantise_int8", "int8_scale_shape", "Quantised", "Packed", "is_quantised", "is_low",
           "refusal", "holds"]

FLOAT8 = "float8_e4m3fn"
INT8 = "int8"  # weights_dtype="int8": symmetric, per output channel, quantised once at load (quantise_int8)
_LOW = (jnp.dtype(jnp.float8_e4m3fn),)


@dataclass(frozen=True)
class Quantised:
    """A weight kept on the device as stored, expanded where it is used (``upcast``, inside the
    jitted apply): ``values * scale``, with one scale per tensor or per block of ``values``; a
    Linear's weight with a per-output scale instead scales the product (``product``).

    ``scale`` has the rank of ``values`` and divides its shape axis by axis (each scale covers a
    block ``values.shape[i] // scale.shape[i]`` long on axis i), or is a scalar (one per tensor)::

        scaled fp8   values (in, out) float8_e4m3fn   scale ()            float32
                     (per output channel)             scale (1, out)      float32
        GGUF Q8_0    values (in, out) int8            scale (in/32, out)  float16
        int8 (load)  values (in, out) int8            scale (1, out)      float32   (``quantise_int8``;
                     a conv's (kh, kw, in, out)       scale (1, 1, 1, out))

    A pytree (its two arrays are leaves), so it is placed, sharded, keyed and traced like any
    parameter; ``shape`` and ``dtype`` are the stored values' (what a layer's ``kernel.shape`` reads).
    """

    values: Any  # the stored elements, in the parameter's (jax) layout
    scale: Any  # () per tensor, or values' rank with each axis dividing values'

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self) -> Any:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) + int(self.scale.nbytes)

    @property
    def per_output(self) -> bool:
        """Whether the scale varies along the last (output) axis only: one per tensor, or one per
        output channel (a scaled fp8 file's ``(out, 1)`` scales, ``(1, out)`` here). Such a scale
        commutes with a product over the other axes; a block scale along the input (GGUF Q8_0's
        ``(in/32, out)``) does not."""
        return all(m == 1 for m in self.scale.shape[:-1])

    def converted(self, dtype: Any) -> Quantised:
        """The values in ``dtype`` (the compute dtype), the scale as it is: what ``product`` takes."""
        return Quantised(self.values.astype(dtype), self.scale)

    def product(self, x: Any) -> Any:
        """``x @ (values * scale)`` for a 2-D weight, in ``x.dtype``. With a per-output scale it is
        ``(x @ values) * scale``: the scale multiplies the float32 accumulator in the GEMM's epilogue,
        so the values' convert fuses into the GEMM's operand read and no scaled copy of the weight is
        written (seen in the HLO compiled for an H200: one kernel, against two with the scale on the
        weight; a bf16 product before the scale left a second kernel for per-channel scales). Any
        other scale is expanded onto the weight first."""
        if not self.per_output:
            return x @ self.expand(x.dtype)
        y = jnp.matmul(x, self.values.astype(x.dtype), preferred_element_type=jnp.float32)  # (..., out)
        scale = self.scale.astype(jnp.float32)
        if scale.ndim:
            scale = scale.reshape((1,) * (y.ndim - 1) + (-1,))  # (1, ..., 1, out): no rank promotion
        return (y * scale).astype(x.dtype)

    def matrix(self) -> Quantised:
        """A 1x1 convolution's ``(1, 1, in, out)`` weight as the ``(in, out)`` matrix it multiplies
        each pixel by, its scale alike (``(1, 1, s, out)`` -> ``(s, out)``; a scalar as it is): the
        convolution is then ``product`` over the channel axis, one GEMM. A kxk convolution is not
        (cuDNN reads a bf16 weight in its own layout: a copy XLA writes at every use anyway, with
        the scale fused into it; see ``layers.Conv2d``)."""
        scale = self.scale.reshape(self.scale.shape[2:]) if self.scale.ndim else self.scale
        return Quantised(self.values.reshape(self.values.shape[2:]), scale)  # (in, out), (s, out) or ()

    def expand(self, dtype: Any) -> Any:
        """``values * scale`` in float32 (the arithmetic a host dequantisation does), then ``dtype``."""
        values = self.values.astype(jnp.float32)
        scale = self.scale.astype(jnp.float32)
        if scale.ndim == 0:
            return (values * scale).astype(dtype)
        blocks = [n // m for n, m in zip(values.shape, scale.shape)]
        split = [d for m, b in zip(scale.shape, blocks) for d in (m, b)]  # (s0, b0, s1, b1, ...)
        spread = [d for m in scale.shape for d in (m, 1)]  # (s0, 1, s1, 1, ...)
        return (values.reshape(split) * scale.reshape(spread)).reshape(values.shape).astype(dtype)


jax.tree_util.register_dataclass(Quantised, data_fields=["values", "scale"], meta_fields=[])


@dataclass(frozen=True)
class Packed:
    """A GGUF weight kept on the device as the file's blocks, expanded where it is used (``upcast``,
    inside the jitted apply) by ``ggml.dequantise``: the point of a Q4_K file is its bytes, so they
    are never widened at rest::

        GGUF Q4_K   blocks (in/256, 144, out) uint8   kind "Q4_K"   (``ggml.LAYOUTS``)

    A pytree with one leaf, ``blocks`` (placed, sharded and keyed like any parameter; a block's byte
    width differs between kinds, so a compile key's shapes tell the kinds apart), ``kind`` static.
    ``shape`` is the weight's (jax layout, ``(in, out)``), ``dtype`` the stored bytes'."""

    blocks: Any  # uint8 (in / QK, BYTES, out)
    kind: str  # a key of ggml.LAYOUTS

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.blocks.shape[0]) * LAYOUTS[self.kind].qk, int(self.blocks.shape[-1]))

    @property
    def dtype(self) -> Any:
        return self.blocks.dtype

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)

    def expand(self, dtype: Any) -> Any:
        """The weight ``(in, out)``: gguf's dequantisation in float32 (bit for bit), then ``dtype``."""
        return dequantise(self.blocks, self.kind).astype(dtype)


jax.tree_util.register_dataclass(Packed, data_fields=["blocks"], meta_fields=["kind"])


def int8_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale's shape of an int8 weight of (jax-layout) ``shape``: one per output channel, the
    last axis (a Linear's ``(in, out)``, a conv's ``(kh, kw, in, out)``; an Embedding's ``(n, dim)``:
    one per feature)."""
    return (1,) * (len(shape) - 1) + (shape[-1],)


@jax.jit
def quantise_int8(weight: Any) -> tuple[Any, Any]:
    """``weight`` (jax layout, any float dtype) as int8 values and float32 scales, symmetric per
    output channel (the last axis): ``scale = max|w| * (1 / 127)`` over the channel, ``q = round(w *
    (1 / scale))`` (half to even, as numpy and torch round), all in float32. ``q * scale`` is the
    weight the program computes with; a channel of zeros gets scale 0 and values 0. The reciprocals
    are written out because XLA turns a division by a constant or a broadcast into such a product
    anyway (a rounding away from the quotient, seen on its CPU backend): so written, the rule is the
    same on every backend and in the torch reference (tests/_support/int8_reference.py).

    Run once at load, on the device the weight was placed on (``weights.fill``): the checkpoint's
    tensor goes there as stored, and this program leaves its int8 values and scales. On the host,
    numpy took about a second per 38 M parameters (one thread): minutes for FLUX.1's 12 B.

    Why per output channel and not per tensor: one outlier channel (Flux's modulation rows) would
    otherwise cost every other channel its resolution; and a scale per output commutes with the
    product (``x @ (q * s) == (x @ q) * s``), so the layer multiplies the int8 values in the GEMM and
    scales its output (``Quantised.product``): no dequantised copy of the weight is ever written."""
    w = jnp.asarray(weight).astype(jnp.float32)  # (..., out)
    scale = jnp.max(jnp.abs(w), axis=tuple(range(w.ndim - 1)), keepdims=True) * np.float32(1 / 127)  # (1, ..., 1, out)
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(w * (1.0 / safe)), -127, 127).astype(jnp.int8)
    return q, scale


def is_quantised(x: Any) -> bool:
    """A weight kept compact with what expands it: ``Quantised`` or ``Packed`` (one pytree node)."""
    return isinstance(x, (Quantised, Packed))


def is_low(dtype: Any) -> bool:
    """Whether ``dtype`` is a storage dtype that ``upcast`` converts."""
    return np.dtype(dtype) in _LOW


def refusal(device: Any, dtype: str) -> str | None:
    """Why ``device`` cannot hold ``dtype`` weights and upcast them in a compiled program, or None:
    a tiny array of it is placed there and upcast, as a denoiser's weights will be."""
    try:
        probe = jax.device_put(np.zeros((2,), jnp.dtype(dtype)), device)
        jax.block_until_ready(jax.jit(lambda x: x.astype(jnp.float32) * 2)(probe))
    except Exception as exc:  # the runtime's own refusal, whatever its type
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


@functools.cache
def _holds(device: Any, dtype: str) -> bool:
    return refusal(device, dtype) is None


def holds(dtype: Any) -> bool:
    """Whether the default device holds ``dtype`` weights (probed once per device and dtype): a
    file's fp8 weights stay fp8 there without ``weights_dtype``, or are upcast on the host."""
    return _holds(jax.devices()[0], jnp.dtype(dtype).name)
