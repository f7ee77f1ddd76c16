"""GGUF files as city96's FLUX GGUFs lay them out (BFL's transformer keys), written by ``gguf``'s own
writer and quantiser::

    write_gguf(path, tensors, quant) -> {name: GGML type}
    quantize(rows, kind)             -> the blocks (uint8, (..., in / QK * BYTES))

``gguf`` 0.19 quantises Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 but only reads the K types (Q2_K..Q6_K)
and IQ4_NL/IQ4_XS, so their blocks are written here: a plain min/max quantiser per sub-block (not
llama.cpp's search; for the IQ4 types, the scale that maps the block's largest magnitude to the
table's -127, as llama.cpp starts from, then each value's nearest table entry), packed as
ggml-common.h lays each block out. What makes them right is that ``gguf``'s own ``dequantize``
reads them back to the weights within a quantisation step (``tests/models/test_ggml.py`` checks
it), independently of preheat's reading.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
IQ4_TYPES = ("IQ4_NL", "IQ4_XS")
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml-common.h


def write_gguf(path: Any, tensors: dict[str, np.ndarray], quant: Any) -> dict[str, str]:
    """``tensors`` as a GGUF file: 2-D weights whose rows are whole blocks in ``quant`` (a
    ``gguf.GGMLQuantizationType``, or a callable ``name -> type`` choosing per weight, as a
    Q4_K_M file mixes Q4_K and Q6_K), other 2-D tensors F16, 1-D ones F32 (as city96's files keep
    biases and norms); returns {name: type}."""
    import gguf

    choose: Callable[[str], Any] = quant if callable(quant) and not isinstance(quant, gguf.GGMLQuantizationType) \
        else (lambda _: quant)
    writer = gguf.GGUFWriter(str(path), arch="flux")
    types = {}
    for key, value in tensors.items():
        value = np.asarray(value, np.float32)
        kind = choose(key) if value.ndim == 2 and key.endswith(".weight") else None
        if kind is not None and value.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] == 0:
            writer.add_tensor(key, quantize(value, kind), raw_dtype=kind)
            types[key] = kind.name
        elif value.ndim >= 2:
            writer.add_tensor(key, value.astype(np.float16))
            types[key] = "F16"
        else:
            writer.add_tensor(key, value)
            types[key] = "F32"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def quantize(rows: np.ndarray, kind: Any) -> np.ndarray:
    """``rows`` (..., in) float32 as ``kind``'s blocks: ``gguf.quants.quantize`` where it quantises,
    else this module's K-type or IQ4 writer."""
    import gguf

    kind = gguf.GGMLQuantizationType[kind] if isinstance(kind, str) else kind
    if kind.name not in _WRITERS:
        return gguf.quants.quantize(rows, kind)
    lead, width = rows.shape[:-1], rows.shape[-1]
    qk = gguf.GGML_QUANT_SIZES[kind][0]
    blocks = np.asarray(rows, np.float32).reshape(-1, qk)  # (n, QK): one (super-)block each
    out = _WRITERS[kind.name](blocks)
    return out.reshape(*lead, width // qk * out.shape[-1])


def _f16(x: np.ndarray) -> np.ndarray:
    """(n,) float -> (n, 2) uint8, little-endian float16."""
    return np.asarray(x, np.float16).reshape(-1, 1).view(np.uint8)


def _min_k(x: np.ndarray, sub: int, levels: int, bits: int) -> tuple[np.ndarray, ...]:
    """Affine sub-blocks ``d*sc * q - dmin*m`` (Q2_K, Q4_K, Q5_K): x (n, 256) -> d, dmin (n,),
    sc, m (n, 256/sub) in 0..2^bits-1, q (n, 256) in 0..levels."""
    n = x.shape[0]
    g = x.reshape(n, -1, sub)
    lo = np.minimum(g.min(axis=2), 0)  # (n, s): the sub-block's offset, never positive
    top = (1 << bits) - 1
    span = g.max(axis=2) - lo
    d = (span.max(axis=1, keepdims=True) / levels / top).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=1, keepdims=True) / top).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.rint(span / levels / d), 0).clip(0, top)
        m = np.where(dmin > 0, np.rint(-lo / dmin), 0).clip(0, top)
        scale = (d * sc)[:, :, None]
        q = np.where(scale > 0, np.rint((g + (dmin * m)[:, :, None]) / scale), 0).clip(0, levels)
    return d[:, 0], dmin[:, 0], sc.astype(np.uint8), m.astype(np.uint8), q.reshape(n, 256).astype(np.uint8)


def _fields(q: np.ndarray, group: int, shifts: tuple[int, ...]) -> np.ndarray:
    """The inverse of reading ``group``-byte runs once per shift: q (n, k) small ints -> bytes
    (n, k / len(shifts)), value j of run r at shift s in byte ``r*group + j``."""
    n = q.shape[0]
    parts = q.reshape(n, -1, len(shifts), group).astype(np.uint8)
    out = np.zeros((n, parts.shape[1], group), np.uint8)
    for i, s in enumerate(shifts):
        out |= parts[:, :, i, :] << np.uint8(s)
    return out.reshape(n, -1)


def _scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's eight 6-bit scales and mins (n, 8) -> 12 bytes (n, 12)."""
    d = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    mm = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([d, mm, md], axis=1).astype(np.uint8)


def _q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _min_k(x, 16, 3, 4)
    return np.concatenate([sc | (m << 4), _fields(q, 32, (0, 2, 4, 6)), _f16(d), _f16(dmin)], axis=1)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _min_k(x, 32, 15, 6)
    return np.concatenate([_f16(d), _f16(dmin), _scales_k4(sc, m), _fields(q, 32, (0, 4))], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _min_k(x, 32, 31, 6)
    high = _fields(q >> 4, 32, tuple(range(8)))  # (n, 32): bit b of byte p is value b*32+p's 5th bit
    return np.concatenate([_f16(d), _f16(dmin), _scales_k4(sc, m), high, _fields(q & 0x0F, 32, (0, 4))], axis=1)


def _symmetric(x: np.ndarray, sub: int, low: int, high: int, top: int) -> tuple[np.ndarray, ...]:
    """Symmetric sub-blocks ``d*sc * q`` (Q3_K, Q6_K): d (n,), sc (n, 256/sub) in 0..top, q in low..high."""
    n = x.shape[0]
    g = x.reshape(n, -1, sub)
    step = np.abs(g).max(axis=2) / -low  # (n, s)
    d = (step.max(axis=1, keepdims=True) / top).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.rint(step / d), 0).clip(0, top)
        scale = (d * sc)[:, :, None]
        q = np.where(scale > 0, np.rint(g / scale), 0).clip(low, high)
    return d[:, 0], sc.astype(np.int32), q.reshape(n, 256).astype(np.int32)


def _q3_k(x: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric(x, 16, -4, 3, 31)
    stored = (sc + 32).astype(np.uint8)  # 6 bits, offset 32
    scales = np.concatenate([_fields(stored & 0x0F, 8, (0, 4)), _fields(stored >> 4, 4, (0, 2, 4, 6))], axis=1)
    hmask = _fields((q >= 0).astype(np.uint8), 32, tuple(range(8)))  # 1: q = ql; 0: q = ql - 4
    ql = _fields(((q + 4) & 3).astype(np.uint8), 32, (0, 2, 4, 6))
    return np.concatenate([hmask, ql, scales, _f16(d)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric(x, 16, -32, 31, 127)
    u = (q + 32).astype(np.uint8)  # 0..63
    ql = _fields(u & 0x0F, 64, (0, 4))
    qh = _fields(u >> 4, 32, (0, 2, 4, 6))
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d)], axis=1)


def _nearest_kv(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The index of each ``x / scale``'s nearest ``KVALUES_IQ4NL`` entry (x (n, k), scale (n, 1));
    1 (index 8, the entry nearest 0) where the scale is 0."""
    kv = np.asarray(KVALUES_IQ4NL, np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(scale != 0, x / scale, 0)
    return np.abs(t[..., None] - kv).argmin(axis=-1).astype(np.uint8)


def _signed_max(g: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis, with its sign: (..., k) -> (...)."""
    return np.take_along_axis(g, np.abs(g).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    d = (_signed_max(x) / KVALUES_IQ4NL[0]).astype(np.float16).astype(np.float32)  # (n,): the extreme -> -127
    return np.concatenate([_f16(d), _fields(_nearest_kv(x, d[:, None]), 16, (0, 4))], axis=1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    g = x.reshape(n, 8, 32)
    sub = _signed_max(g) / KVALUES_IQ4NL[0]  # (n, 8): each sub-block's scale, signed
    d = (_signed_max(sub) / -32).astype(np.float16).astype(np.float32)  # (n,): the largest scale -> ls - 32 = -32
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.where(d[:, None] != 0, np.rint(sub / d[:, None]), 0).clip(-32, 31).astype(np.int32) + 32  # 0..63
    dl = (d[:, None] * (ls - 32)).reshape(n * 8, 1)
    q = _nearest_kv(g.reshape(n * 8, 32), dl).reshape(n, 256)
    scales_h = _fields((ls >> 4).astype(np.uint8), 1, (0, 2, 4, 6))  # (n, 2): a little-endian uint16, 2 bits each
    scales_l = _fields((ls & 0x0F).astype(np.uint8), 1, (0, 4))  # (n, 4): a nibble each
    return np.concatenate([_f16(d), scales_h, scales_l, _fields(q, 16, (0, 4))], axis=1)


_WRITERS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl,
            "IQ4_XS": _iq4_xs}
