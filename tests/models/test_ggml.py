"""GGML block types unpacked in a compiled program (``preheat.models.ggml``) against the reference:
``gguf.quants.dequantize``, the numpy reading the ``gguf`` package ships, on random blocks.

Every float product in these formats is exact in float32 (an f16 scale's 11 significant bits
times integers of at most 13 bits; IQ4's table values are such integers, -127..113), so both sides
round once, at the final ``+ m`` / ``- dmin*m``, or never:
the comparison is bit for bit (``view(uint32)``), not to a tolerance. The blocks are random bytes
with random finite float16 scales (zeros, subnormals and negatives among them)."""

from __future__ import annotations

import numpy as np
import pytest

from preheat.models.ggml import LAYOUTS
from preheat.models.quantised import Packed

gguf = pytest.importorskip("gguf")

F16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}  # each block's float16 fields


def _random_rows(kind: str, out: int, blocks: int, seed: int) -> np.ndarray:
    """(out, blocks * BYTES) uint8: random bytes, the float16 fields finite."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (out, blocks, LAYOUTS[kind].nbytes), dtype=np.uint8)
    for at in F16_AT[kind]:
        v = (rng.standard_normal((out, blocks)) * 10.0 ** rng.uniform(-9, 2, (out, blocks))).astype(np.float16)
        data[:, :, at:at + 2] = v.view(np.uint8).reshape(out, blocks, 2)
    return data.reshape(out, -1)


def test_the_layouts_are_ggmls():
    assert {k: (v.qk, v.nbytes) for k, v in LAYOUTS.items()} == \
        {k: tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[k]]) for k in LAYOUTS}


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_the_compiled_unpacking_is_ggufs_dequantisation_bit_for_bit(kind):
    import jax

    rows = _random_rows(kind, out=24, blocks=3, seed=list(LAYOUTS).index(kind))
    want = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[kind])  # (out, in) float32
    blocks = rows.reshape(24, 3, LAYOUTS[kind].nbytes).transpose(1, 2, 0)  # the kernel's layout (in/QK, BYTES, out)
    got = np.asarray(jax.jit(lambda b: Packed(b, kind).expand(np.float32))(blocks)).T
    assert got.shape == want.shape == (24, 3 * LAYOUTS[kind].qk)
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert Packed(blocks, kind).shape == (3 * LAYOUTS[kind].qk, 24)


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_the_test_files_blocks_read_back_as_their_weights(kind):
    """``tests/_support/gguf_files.quantize`` writes the K and IQ4 types' blocks itself (gguf reads
    them but cannot write them): gguf's own reading of them is the weights within a quantisation step."""
    from tests._support.gguf_files import quantize

    w = np.random.default_rng(1).standard_normal((8, 512)).astype(np.float32) * 0.05
    back = gguf.quants.dequantize(quantize(w, kind), gguf.GGMLQuantizationType[kind])
    error = np.sqrt(np.mean((back - w) ** 2) / np.mean(w ** 2))
    bits = int(kind.lstrip("IQ")[0])  # Q2_K: 2, ..., IQ4_XS: 4
    assert error < 2.0 ** (1 - bits), error  # 2 bits: 0.5 of the weights' rms; 6 bits: 1/32

