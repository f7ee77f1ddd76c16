"""GGML's block quantisations, unpacked inside a compiled program (jnp integer and bit arithmetic).

A GGUF weight of one of these types is a row-major sequence of blocks along its input axis: each
block holds ``QK`` values in ``BYTES`` bytes (its scales first or last, then packed integers).
preheat keeps those bytes on the device as they are (``quantised.Packed``) in the kernel's layout,

    blocks  uint8  (in / QK, BYTES, out)     block i of every output column, byte by byte

and ``dequantise`` expands them to ``(in / QK, QK, out)`` float32 where the weight is used. The
layouts are llama.cpp's (ggml-common.h), as the ``gguf`` package's numpy ``gguf.quants`` reads them:

    type   QK   BYTES  block                                         value
    Q4_0   32    18    d f16 | qs 16 (nibbles)                         d * (q - 8)
    Q4_1   32    20    d f16 | m f16 | qs 16                           d * q + m
    Q5_0   32    22    d f16 | qh 4 (bit 5 of each) | qs 16            d * (q - 16)
    Q5_1   32    24    d f16 | m f16 | qh 4 | qs 16                    d * q + m
    Q2_K   256   84    scales 16 (4+4 bit) | qs 64 (2 bit) | d | dmin  d*sc * q - dmin*m   (16 of 16)
    Q3_K   256  110    hmask 32 | qs 64 (2 bit) | scales 12 (6 bit) | d   d*(sc-32) * q   (16 of 16)
    Q4_K   256  144    d | dmin | scales 12 (6+6 bit) | qs 128         d*sc * q - dmin*m   (8 of 32)
    Q5_K   256  176    d | dmin | scales 12 | qh 32 | qs 128           d*sc * q - dmin*m   (8 of 32)
    Q6_K   256  210    ql 128 | qh 64 | scales 16 (int8) | d           d*sc * (q - 32)   (16 of 16)
    IQ4_NL  32   18    d f16 | qs 16 (nibbles)                         d * kv[q]
    IQ4_XS 256  136    d | scales_h 2 | scales_l 4 | qs 128 (nibbles)  d*(ls-32) * kv[q]   (8 of 32)

``kv`` is llama.cpp's fixed non-linear table ``kvalues_iq4nl`` (16 int8, -127 .. 113): the IQ4
types look their 4-bit indices up in it (``jnp.take``), laid out as Q4_0's nibbles (per 32-block
for IQ4_XS), and an IQ4_XS sub-block's 6-bit scale ``ls`` is 4 low bits from ``scales_l`` and 2
high ones from ``scales_h``.

Every float product here is exact in float32 (an f16 scale has 11 significant bits, the integers
it multiplies at most 13 together; IQ4_XS's ``(ls - 32) * kv[q]`` is at most 32 * 127 = 4064, 12
bits), so the one rounding is the final ``+ m`` / ``- dmin*m``, and the types without one (Q4_0,
Q5_0, Q3_K, Q6_K, IQ4_NL, IQ4_XS) do not round at all: the result is gguf's numpy dequantisation
bit for bit, whatever order or fusion (FMA) XLA chooses. (gguf computes IQ4_XS as
``(d * (ls - 32)) * kv[q]``, as here; every partial product is exact too, so the order is moot.)
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Layout", "LAYOUTS", "KVALUES_IQ4NL", "dequantise"]


class Layout(NamedTuple):
    """One block type: ``qk`` values in ``nbytes`` bytes."""

    qk: int
    nbytes: int


LAYOUTS = {"Q4_0": Layout(32, 18), "Q4_1": Layout(32, 20), "Q5_0": Layout(32, 22), "Q5_1": Layout(32, 24),
           "Q2_K": Layout(256, 84), "Q3_K": Layout(256, 110), "Q4_K": Layout(256, 144), "Q5_K": Layout(256, 176),
           "Q6_K": Layout(256, 210), "IQ4_NL": Layout(32, 18), "IQ4_XS": Layout(256, 136)}

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml-common.h


def _f16(b: jax.Array, at: int) -> jax.Array:
    """The little-endian float16 at byte ``at`` of each block, as float32: (N, O) -> (N, 1, O)."""
    bits = b[:, at].astype(jnp.uint16) | (b[:, at + 1].astype(jnp.uint16) << 8)  # (N, O)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)[:, None]


def _bits(x: jax.Array, group: int, shifts: tuple[int, ...], mask: int) -> jax.Array:
    """Fields of ``x`` (N, n, O) uint8: each run of ``group`` bytes read once per shift, in shift
    order -> (N, n * len(shifts), O) int32; ``group=1`` reads a byte's fields one after another."""
    n, o = x.shape[1], x.shape[2]
    s = jnp.asarray(shifts, jnp.uint8).reshape(1, 1, -1, 1, 1)
    out = (x.reshape(x.shape[0], n // group, 1, group, o) >> s) & jnp.uint8(mask)  # (N, n/group, k, group, O)
    return out.reshape(x.shape[0], n * len(shifts), o).astype(jnp.int32)


def _nibbles(qs: jax.Array) -> jax.Array:
    """A 32-block's 16 bytes of 4-bit values (low nibbles, then high): (N, 16, O) -> (N, 32, O)."""
    return _bits(qs, 16, (0, 4), 0x0F)


def _fifth(qh: jax.Array) -> jax.Array:
    """The 5th bits of a 32-block (a little-endian uint32, bit j for value j): (N, 4, O) -> (N, 32, O)."""
    return _bits(qh, 1, tuple(range(8)), 1)


def _f32(q: jax.Array) -> jax.Array:
    return q.astype(jnp.float32)


def _q4_0(b: jax.Array) -> jax.Array:
    return _f16(b, 0) * _f32(_nibbles(b[:, 2:18]) - 8)


def _q4_1(b: jax.Array) -> jax.Array:
    return _f16(b, 0) * _f32(_nibbles(b[:, 4:20])) + _f16(b, 2)


def _q5_0(b: jax.Array) -> jax.Array:
    q = _nibbles(b[:, 6:22]) | (_fifth(b[:, 2:6]) << 4)  # (N, 32, O) in 0..31
    return _f16(b, 0) * _f32(q - 16)


def _q5_1(b: jax.Array) -> jax.Array:
    q = _nibbles(b[:, 8:24]) | (_fifth(b[:, 4:8]) << 4)
    return _f16(b, 0) * _f32(q) + _f16(b, 2)


def _sub(x: jax.Array, size: int) -> jax.Array:
    """(N, 256, O) -> (N, 256 / size, size, O): a super-block's sub-blocks."""
    return x.reshape(x.shape[0], -1, size, x.shape[-1])


def _q2_k(b: jax.Array) -> jax.Array:
    n, o = b.shape[0], b.shape[-1]
    scales = b[:, :16].astype(jnp.int32)  # (N, 16, O): low nibble the scale, high the min
    d, dmin = _f16(b, 80), _f16(b, 82)  # (N, 1, O)
    dl, ml = (d * _f32(scales & 0xF))[:, :, None], (dmin * _f32(scales >> 4))[:, :, None]  # (N, 16, 1, O)
    q = _sub(_bits(b[:, 16:80], 32, (0, 2, 4, 6), 3), 16)  # (N, 16, 16, O) in 0..3
    return (dl * _f32(q) - ml).reshape(n, 256, o)


def _q3_k(b: jax.Array) -> jax.Array:
    n, o = b.shape[0], b.shape[-1]
    low = _bits(b[:, 96:104], 8, (0, 4), 0x0F)  # (N, 16, O): bits 0-3 of the 16 scales
    high = _bits(b[:, 104:108], 4, (0, 2, 4, 6), 3)  # (N, 16, O): bits 4-5
    dl = (_f16(b, 108) * _f32((low | (high << 4)) - 32))[:, :, None]  # (N, 16, 1, O)
    ql = _bits(b[:, 32:96], 32, (0, 2, 4, 6), 3)  # (N, 256, O) in 0..3
    hm = _bits(b[:, :32], 32, tuple(range(8)), 1)  # (N, 256, O): 1 keeps ql, 0 subtracts 4
    q = _sub(ql - ((hm ^ 1) << 2), 16)  # (N, 16, 16, O) in -4..3
    return (dl * _f32(q)).reshape(n, 256, o)


def _scale_min_k4(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins: (N, 12, O) -> 2 x (N, 8, O)."""
    s = s.astype(jnp.int32)
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]  # (N, 4, O) each
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _k4(b: jax.Array, q: jax.Array) -> jax.Array:
    """``d*sc * q - dmin*m`` over 8 sub-blocks of 32 (Q4_K, Q5_K; q: (N, 256, O))."""
    n, o = b.shape[0], b.shape[-1]
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl, ml = (_f16(b, 0) * _f32(sc))[:, :, None], (_f16(b, 2) * _f32(mn))[:, :, None]  # (N, 8, 1, O)
    return (dl * _f32(_sub(q, 32)) - ml).reshape(n, 256, o)


def _q4_k(b: jax.Array) -> jax.Array:
    return _k4(b, _bits(b[:, 16:144], 32, (0, 4), 0x0F))


def _q5_k(b: jax.Array) -> jax.Array:
    q = _bits(b[:, 48:176], 32, (0, 4), 0x0F) | (_bits(b[:, 16:48], 32, tuple(range(8)), 1) << 4)
    return _k4(b, q)


def _q6_k(b: jax.Array) -> jax.Array:
    n, o = b.shape[0], b.shape[-1]
    scales = jax.lax.bitcast_convert_type(b[:, 192:208], jnp.int8).astype(jnp.int32)  # (N, 16, O)
    dl = (_f16(b, 208) * _f32(scales))[:, :, None]  # (N, 16, 1, O)
    q = _bits(b[:, :128], 64, (0, 4), 0x0F) | (_bits(b[:, 128:192], 32, (0, 2, 4, 6), 3) << 4)  # (N, 256, O)
    return (dl * _f32(_sub(q - 32, 16))).reshape(n, 256, o)


def _kv(q: jax.Array) -> jax.Array:
    """IQ4's 4-bit indices (int32 in 0..15) -> their ``KVALUES_IQ4NL`` values, float32 (exact)."""
    return jnp.take(jnp.asarray(KVALUES_IQ4NL, jnp.float32), q, mode="clip")  # q is a nibble: in bounds


def _iq4_nl(b: jax.Array) -> jax.Array:
    return _f16(b, 0) * _kv(_nibbles(b[:, 2:18]))


def _iq4_xs(b: jax.Array) -> jax.Array:
    n, o = b.shape[0], b.shape[-1]
    high = _bits(b[:, 2:4], 1, (0, 2, 4, 6), 3)  # (N, 8, O): scales_h (little-endian uint16) bits 2ib, 2ib+1
    low = _bits(b[:, 4:8], 1, (0, 4), 0x0F)  # (N, 8, O): scales_l[ib // 2] >> 4 * (ib % 2)
    dl = (_f16(b, 0) * _f32((low | (high << 4)) - 32))[:, :, None]  # (N, 8, 1, O)
    q = _bits(b[:, 8:136], 16, (0, 4), 0x0F)  # (N, 256, O): each sub-block's 16 bytes, low nibbles then high
    return (dl * _sub(_kv(q), 32)).reshape(n, 256, o)


_UNPACK: dict[str, Callable[[jax.Array], jax.Array]] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs}


def dequantise(blocks: jax.Array, kind: str) -> jax.Array:
    """``kind``'s blocks (in / QK, BYTES, out) uint8 -> the weight (in, out) float32."""
    layout = LAYOUTS[kind]
    n, nbytes, o = blocks.shape
    assert nbytes == layout.nbytes, (kind, blocks.shape)
    return _UNPACK[kind](blocks).reshape(n * layout.qk, o)  # (N, QK, O) -> (in, out)
