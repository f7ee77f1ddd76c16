"""Layers the diffusion transformers share (Flux's and SD3's MMDiT blocks), written once.

Named like diffusers' submodules, so a parameter path is its checkpoint key in both models.
Statistics run in float32 whatever the activations' dtype, as diffusers' norms do.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from preheat.errors import ModelNotFoundError
from preheat.models.layers import Linear

__all__ = ["NORM_EPS", "layer_norm", "modulate", "AdaLayerNormContinuous", "GELU", "FeedForward",
           "resolve_transformer_dir"]

Array = jax.Array
NORM_EPS = 1e-6  # every weightless LayerNorm of both models (adaLN, the output norm)


def layer_norm(x: Array, eps: float = NORM_EPS) -> Array:
    """``nn.LayerNorm(elementwise_affine=False)`` over the last axis; float32 statistics."""
    h = x.astype(jnp.float32)
    mean = h.mean(axis=-1, keepdims=True)
    var = jnp.square(h - mean).mean(axis=-1, keepdims=True)
    return ((h - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def modulate(x: Array, shift: Array, scale: Array) -> Array:
    """adaLN: (B, L, D) * (1 + scale) + shift, with (B, D) modulations."""
    return x * (1 + scale[:, None, :]) + shift[:, None, :]


class AdaLayerNormContinuous(nnx.Module):
    """``norm_out`` (and SD3's last ``norm1_context``): scale *then* shift, unlike adaLN-Zero."""

    def __init__(self, dim: int, cond_dim: int, *, rngs: nnx.Rngs):
        self.linear = Linear(cond_dim, 2 * dim, rngs=rngs)

    def __call__(self, x: Array, cond: Array) -> Array:  # (B, L, D), (B, Dc) -> (B, L, D)
        scale, shift = jnp.split(self.linear(jax.nn.silu(cond).astype(x.dtype)), 2, axis=-1)
        return modulate(layer_norm(x), shift, scale)


class GELU(nnx.Module):
    """diffusers' ``GELU(approximate="tanh")`` (``ff.net.0``): a projection, then tanh-GELU."""

    def __init__(self, dim: int, inner: int, *, rngs: nnx.Rngs):
        self.proj = Linear(dim, inner, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return jax.nn.gelu(self.proj(x), approximate=True)


class FeedForward(nnx.Module):
    """``FeedForward(activation_fn="gelu-approximate")``: ``net.0`` GELU, ``net.1`` dropout (no
    weights), ``net.2`` Linear."""

    def __init__(self, dim: int, *, mult: int = 4, rngs: nnx.Rngs):
        self.net = nnx.List([GELU(dim, dim * mult, rngs=rngs), None, Linear(dim * mult, dim, rngs=rngs)])

    def __call__(self, x: Array) -> Array:  # (B, L, D) -> (B, L, D)
        return self.net[2](self.net[0](x))


def resolve_transformer_dir(path: str | Path, class_name: str) -> Path:
    """The folder holding a transformer's config.json: itself, or a pipeline folder's ``transformer/``."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelNotFoundError(f"transformer folder {p} does not exist")
    if (p / "model_index.json").is_file() or ((p / "transformer").is_dir() and not (p / "config.json").is_file()):
        p = p / "transformer"
        if not p.is_dir():
            raise ModelNotFoundError(f"pipeline folder {p.parent} has model_index.json but no transformer/ folder")
    if not (p / "config.json").is_file():
        raise ModelNotFoundError(f"{p} has no config.json (expected a diffusers {class_name} folder)")
    return p
