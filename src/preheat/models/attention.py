"""Attention: cuDNN's fused kernel where its constraints hold on the GPU that compiles the
program, XLA's attention elsewhere -- chosen per layer, at trace time.

cuDNN's fused attention takes bf16/fp16 in BTNH layout with a head dim that is a multiple of
8 and at most 128, and needs a cuDNN package on the compiling machine. Hopper (9.x) would take
heads up to 256, but jax checks that limit against the *running* backend, so heads above 128
(SD 1.5's 160-wide deepest blocks) take XLA's path everywhere.

A deviceless compile (``preheat warm --target``: ``preheat.compile_target.compiling_for``) takes
XLA's path for every layer. XLA builds a fused-attention call's cuDNN graph (its execution plan
and workspace) only when it compiles with the device at hand; compiled without one, the
executable holds the call but no graph, and its thunk finds none at the first run (read in XLA's
GPU compiler and cuDNN thunk, docs/gpu.md). The pod's own trace reads its device and fuses; its
autotuned retune swaps that program in when faster. Every choice depends only on fields the
cache key holds (dtype, head dim, compute capability, cuDNN's version) and on whether the
compile is deviceless, as with convolutions (``preheat.models.conv.conv_impl``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from preheat.compile_target import deviceless, traced_target

__all__ = ["dot_product_attention", "implementation_for"]

Array = jax.Array

def implementation_for(dtype: jnp.dtype, head_dim: int, has_bias_or_mask: bool = False) -> Optional[str]:
    """``jax.nn.dot_product_attention``'s ``implementation`` for one layer: "cudnn" where its
    constraints hold on the GPU compiling it, "xla" on other GPU layers and in every deviceless
    GPU compile (explicit, so that jax never picks what the caller did not), None off the GPU
    (the CPU's program unchanged)."""
    platform, capability = traced_target()
    if platform != "gpu":
        return None
    if deviceless():  # no device, no cuDNN graph: the module docstring
        return "xla"
    from preheat.cache.targets import cudnn_available

    fused = (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 8 == 0
             and head_dim <= 128 and not has_bias_or_mask and capability is not None and capability >= (8, 0)
             and cudnn_available())
    return "cudnn" if fused else "xla"


def dot_product_attention(q: Array, k: Array, v: Array, *, bias: Optional[Array] = None,
                          mask: Optional[Array] = None, is_causal: bool = False,
                          scale: Optional[float] = None) -> Array:
    """``jax.nn.dot_product_attention`` (BTNH: q (B, L, nH, Dh), k/v (B, M, nH, Dh) -> (B, L, nH, Dh))
    with the implementation ``implementation_for`` picks for this layer."""
    impl = implementation_for(q.dtype, q.shape[-1], bias is not None or mask is not None)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=is_causal, scale=scale,
                                        implementation=impl)
