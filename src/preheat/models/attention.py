"""Attention, with the implementation the compile target's platform picks per layer at trace time
(``preheat.platforms``): cuDNN's fused kernel where it can run on a GPU, jax's Pallas flash kernel
for long self-attention on a TPU, XLA's attention elsewhere; the CPU's program is jax's default,
unchanged.

``PREHEAT_ATTENTION`` overrides the choice for measurement: ``xla`` (XLA's attention on every
layer), ``flash`` (the flash kernel on every unmasked layer, with the TPU's blocks; off a TPU it
runs in Pallas's TPU interpret mode, slowly), ``auto`` (default: the platform's). It is a field of
the cache key, like ``PREHEAT_CONV``; every other input of the choice (dtype, head dim, sequence
lengths, the platform and a GPU's compute capability, cuDNN's version, deviceless or not) is in
the key already.

The flash kernel (``jax.experimental.pallas.ops.tpu.flash_attention``, the same in jax 0.10.2 and
0.11.2) takes (B, nH, L, Dh) operands, head dims up to 128 or multiples of 128, and key lengths in
multiples of its key block. ``flash_attention`` pads what it needs: head dims with zeros (q.k and
the output's real columns unchanged; the scale stays the real head dim's), queries to a multiple of
the query block (rows dropped after), keys and values to a multiple of the key block, the padding
masked through the kernel's segment ids (real keys 1, padding 0, every query 1).
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp

from preheat import platforms
from preheat.errors import InvalidArgumentError
from preheat.models.conv import fence

__all__ = ["ATTENTION_IMPLS", "dot_product_attention", "attention_for", "flash_attention"]

Array = jax.Array

ATTENTION_IMPLS = ("xla", "flash")


def attention_for(dtype: jnp.dtype, head_dim: int, q_len: int, kv_len: int, heads: int = 1,
                  masked: bool = False, causal: bool = False) -> platforms.Attention:
    """The implementation of one layer traced now: ``PREHEAT_ATTENTION`` if set, else the compile
    target's platform's choice."""
    layer = platforms.AttentionLayer(jnp.dtype(dtype).name, int(head_dim), int(q_len), int(kv_len), int(heads),
                                     bool(masked), bool(causal))
    forced = os.environ.get("PREHEAT_ATTENTION", "auto")
    if forced == "xla":
        return platforms.Attention("xla")
    if forced == "flash":
        return platforms.Attention("xla") if masked else platforms.flash_choice(layer)
    if forced != "auto":
        raise InvalidArgumentError(f"PREHEAT_ATTENTION={forced!r}; supported: auto, {', '.join(ATTENTION_IMPLS)}",
                                   argument="PREHEAT_ATTENTION")
    return platforms.current().attention(layer, platforms.traced_target()[1], platforms.deviceless())


def dot_product_attention(q: Array, k: Array, v: Array, *, bias: Optional[Array] = None,
                          mask: Optional[Array] = None, is_causal: bool = False,
                          scale: Optional[float] = None) -> Array:
    """``jax.nn.dot_product_attention`` (BTNH: q (B, L, nH, Dh), k/v (B, M, nH, Dh) -> (B, L, nH, Dh))
    with the implementation the platform picks for this layer."""
    choice = attention_for(q.dtype, q.shape[-1], q.shape[1], k.shape[1], q.shape[2],
                           bias is not None or mask is not None, is_causal)
    if choice.impl == "flash":
        return flash_attention(q, k, v, choice, is_causal=is_causal, scale=scale)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=is_causal, scale=scale,
                                        implementation=choice.impl)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def flash_attention(q: Array, k: Array, v: Array, choice: platforms.Attention, *, is_causal: bool = False,
                    scale: Optional[float] = None, interpret: Optional[bool] = None) -> Array:
    """jax's Pallas TPU flash kernel in BTNH layout: q (B, L, nH, Dh), k/v (B, M, nH, Dh) -> (B, L, nH, Dh),
    with ``choice``'s blocks and head dim, padding masked (the module docstring). ``interpret``
    (default: unless the program is traced for a TPU) runs it in Pallas's TPU interpret mode."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    b, l, h, d = q.shape
    m = k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    dp = max(choice.head_dim, d)
    lq, lk = _round_up(l, choice.block_q), _round_up(m, choice.block_k)

    def heads_first(x: Array, length: int) -> Array:  # (B, T, nH, Dh) -> (B, nH, T', Dh'), zero-padded
        x = jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, dp - d)))
        return x.transpose(0, 2, 1, 3)

    segment_ids = None
    if lk != m:  # padded keys: segment 0, never matched by a query's segment 1
        kv = jnp.broadcast_to((jnp.arange(lk) < m).astype(jnp.int32), (b, lk))  # (B, M')
        segment_ids = fa.SegmentIds(q=jnp.ones((b, lq), jnp.int32), kv=kv)
    bq, bk = choice.block_q, choice.block_k
    blocks = fa.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1,
                           block_q_major_dkv=bq, block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq,
                           block_k_major_dq=bk, block_k_dq=bk, block_q_dq=bq)

    q, k, v = fence((q, k, v))  # BTNH as projected: the transpose below is a copy, not the product's epilogue

    def run() -> Array:  # (B, nH, L', Dh')
        return fa.flash_attention(heads_first(q, lq), heads_first(k, lk), heads_first(v, lk), None, segment_ids,
                                  causal=is_causal, sm_scale=float(scale), block_sizes=blocks)

    if interpret is None:
        interpret = platforms.traced_target()[0] != "tpu"
    if interpret:
        with pltpu.force_tpu_interpret_mode():
            out = run()
    else:
        out = run()
    return out[:, :, :l, :d].transpose(0, 2, 1, 3)  # (B, L, nH, Dh)
