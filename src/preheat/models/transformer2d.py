"""The spatial transformer of Stable Diffusion's UNet (diffusers' ``Transformer2DModel`` with
``BasicTransformerBlock``s): self-attention, cross-attention on the text encoder's hidden states
and a GEGLU feed-forward over the H*W tokens of a feature map.

Its own module because it is the one part of ``UNet2DConditionModel`` that is not a ResNet block:
submodules are named exactly like diffusers' (``attn2.to_k``, ``ff.net.0.proj``) so that a parameter
path is its checkpoint key. Attention goes through ``jax.nn.dot_product_attention`` (cuDNN's fused
attention on GPUs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from preheat.models.attention import dot_product_attention
from preheat.models.layers import Conv2d, GroupNorm, LayerNorm, Linear
from preheat.models.stacking import blocks, run_blocks

__all__ = ["CrossAttention", "GEGLU", "FeedForward", "BasicTransformerBlock", "Transformer2DModel"]

Array = jax.Array


class CrossAttention(nnx.Module):
    """diffusers' ``Attention`` as used by ``BasicTransformerBlock``: q/k/v without bias, out with bias.

    Self-attention when ``context`` is None, else cross-attention on ``context`` (the text).
    """

    def __init__(self, dim: int, context_dim: int | None, heads: int, head_dim: int, upcast: bool, *, rngs: nnx.Rngs):
        inner = heads * head_dim
        kv_dim = context_dim if context_dim is not None else dim
        self.to_q = Linear(dim, inner, bias=False, rngs=rngs)
        self.to_k = Linear(kv_dim, inner, bias=False, rngs=rngs)
        self.to_v = Linear(kv_dim, inner, bias=False, rngs=rngs)
        self.to_out = nnx.List([Linear(inner, dim, rngs=rngs)])  # to_out.1 is dropout in torch
        self.heads = heads
        self.head_dim = head_dim
        self.upcast = upcast

    def __call__(self, x: Array, context: Array | None = None) -> Array:  # (B, L, C), (B, M, D) -> (B, L, C)
        ctx = x if context is None else context
        b, n, m = x.shape[0], x.shape[1], ctx.shape[1]
        q = self.to_q(x).reshape(b, n, self.heads, self.head_dim)  # (B, L, nH, Dh)
        k = self.to_k(ctx).reshape(b, m, self.heads, self.head_dim)  # (B, M, nH, Dh)
        v = self.to_v(ctx).reshape(b, m, self.heads, self.head_dim)
        if self.upcast:
            q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
        out = dot_product_attention(q, k, v)  # (B, L, nH, Dh); scale 1/sqrt(Dh)
        out = out.astype(x.dtype).reshape(b, n, self.heads * self.head_dim)
        return self.to_out[0](out)


class GEGLU(nnx.Module):
    def __init__(self, dim: int, inner: int, *, rngs: nnx.Rngs):
        self.proj = Linear(dim, 2 * inner, rngs=rngs)

    def __call__(self, x: Array) -> Array:  # (..., C) -> (..., inner)
        h, gate = jnp.split(self.proj(x), 2, axis=-1)
        return h * jax.nn.gelu(gate, approximate=False)


class FeedForward(nnx.Module):
    """``ff.net.0`` GEGLU, ``ff.net.1`` dropout (no weights), ``ff.net.2`` Linear."""

    def __init__(self, dim: int, *, mult: int = 4, rngs: nnx.Rngs):
        inner = dim * mult
        self.net = nnx.List([GEGLU(dim, inner, rngs=rngs), None, Linear(inner, dim, rngs=rngs)])

    def __call__(self, x: Array) -> Array:
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(nnx.Module):
    """Pre-norm self-attention, cross-attention on the text, GEGLU feed-forward; each residual."""

    def __init__(self, dim: int, heads: int, head_dim: int, context_dim: int, upcast: bool, *, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(dim, 1e-5)
        self.attn1 = CrossAttention(dim, None, heads, head_dim, upcast, rngs=rngs)
        self.norm2 = LayerNorm(dim, 1e-5)
        self.attn2 = CrossAttention(dim, context_dim, heads, head_dim, upcast, rngs=rngs)
        self.norm3 = LayerNorm(dim, 1e-5)
        self.ff = FeedForward(dim, rngs=rngs)

    def __call__(self, x: Array, context: Array) -> Array:  # (B, L, C), (B, M, D) -> (B, L, C)
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class Transformer2DModel(nnx.Module):
    """GroupNorm, project in (1x1 conv or linear), transformer blocks over H*W tokens, project out, residual.

    ``stacked``: a stage deep enough (``stacking.scanned``) keeps its blocks as one ``BlockStack``
    run by a scan (the loaders build it unstacked and ``stacking.stack`` the weights)."""

    def __init__(self, channels: int, heads: int, layers: int, context_dim: int, groups: int, linear: bool,
                 upcast: bool, *, rngs: nnx.Rngs, stacked: bool = False):
        head_dim = channels // heads
        inner = heads * head_dim
        self.norm = GroupNorm(groups, channels, 1e-6)
        self.proj_in = Linear(channels, inner, rngs=rngs) if linear else Conv2d(channels, inner, 1, rngs=rngs)

        def block() -> BasicTransformerBlock:
            return BasicTransformerBlock(inner, heads, head_dim, context_dim, upcast, rngs=rngs)

        self.transformer_blocks = blocks(block, layers, stacked)
        self.proj_out = Linear(inner, channels, rngs=rngs) if linear else Conv2d(inner, channels, 1, rngs=rngs)

    def __call__(self, x: Array, context: Array) -> Array:  # (B, H, W, C), (B, M, D) -> (B, H, W, C)
        b, h, w, _ = x.shape
        y = self.proj_in(self.norm(x))  # (B, H, W, inner): a 1x1 conv and a linear agree on NHWC
        inner = y.shape[-1]
        y = y.reshape(b, h * w, inner)  # (B, L, inner)
        y = run_blocks(self.transformer_blocks, y, lambda block, h: block(h, context))  # a scan when stacked
        y = self.proj_out(y.reshape(b, h, w, inner))  # (B, H, W, C)
        return y + x
