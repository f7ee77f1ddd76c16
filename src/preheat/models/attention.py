"""Attention, with the implementation the compile target's platform picks per layer at trace time
(``preheat.platforms``: cuDNN's fused kernel where it can run on a GPU, XLA's attention elsewhere;
the CPU's program is jax's default, unchanged).

Every choice depends only on fields the cache key holds (dtype, head dim, sequence lengths, the
platform and a GPU's compute capability, cuDNN's version) and on whether the compile is deviceless,
as with convolutions (``preheat.models.conv.conv_impl``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from preheat import platforms

__all__ = ["dot_product_attention", "attention_for"]

Array = jax.Array


def attention_for(dtype: jnp.dtype, head_dim: int, q_len: int, kv_len: int, heads: int = 1,
                  masked: bool = False, causal: bool = False) -> platforms.Attention:
    """The implementation of one layer traced now, as the compile target's platform chooses it."""
    layer = platforms.AttentionLayer(jnp.dtype(dtype).name, int(head_dim), int(q_len), int(kv_len), int(heads),
                                     bool(masked), bool(causal))
    return platforms.current().attention(layer, platforms.traced_target()[1], platforms.deviceless())


def dot_product_attention(q: Array, k: Array, v: Array, *, bias: Optional[Array] = None,
                          mask: Optional[Array] = None, is_causal: bool = False,
                          scale: Optional[float] = None) -> Array:
    """``jax.nn.dot_product_attention`` (BTNH: q (B, L, nH, Dh), k/v (B, M, nH, Dh) -> (B, L, nH, Dh))
    with the implementation the platform picks for this layer."""
    choice = attention_for(q.dtype, q.shape[-1], q.shape[1], k.shape[1], q.shape[2],
                           bias is not None or mask is not None, is_causal)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=is_causal, scale=scale,
                                        implementation=choice.impl)
