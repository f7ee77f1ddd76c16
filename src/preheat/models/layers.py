"""The leaf layers every model here is built from (Conv2d, Linear, the norms, embeddings, the UNet
resnet / attention / resampling blocks), named like diffusers' so that a parameter's path is its
checkpoint key. All NHWC; parameters are made by ``weights.param`` (shapes only in an abstract build).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preheat.errors import InvalidArgumentError
from preheat.models.conv import conv2d, groupnorm_impl
from preheat.models.quantised import Quantised, is_low
from preheat.models.weights import param

__all__ = ["activation", "lift", "Conv2d", "Linear", "GroupNorm", "LayerNorm", "Embedding", "sinusoidal_embedding",
           "GaussianFourierProjection", "TimestepEmbedding", "ResnetBlock2D", "Attention", "Downsample2D",
           "Upsample2D", "nearest_index"]

Array = jax.Array

# Leaf layers. Initialisers matter only for training (train-digits); loading never runs them
# because the model is built abstractly (``weights.build_abstract``: ``param`` makes shapes only)
# and then filled.


def activation(name: str) -> Callable[[Array], Array]:
    name = name.lower()
    return {
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
        "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "relu": jax.nn.relu,
    }[name]


def lift(v: Array, ndim: int) -> Array:
    """(C,) -> (1, ..., 1, C): explicit broadcasting (tests run with rank promotion raising)."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


class Conv2d(nnx.Module):
    """NHWC convolution with an HWIO kernel and symmetric integer padding."""

    def __init__(self, cin: int, cout: int, k: int, *, stride: int = 1, padding: int = 0, rngs: nnx.Rngs):
        fan_in = cin * k * k
        self.kernel = param((k, k, cin, cout), lambda: jax.random.uniform(rngs.params(), (k, k, cin, cout), minval=-1, maxval=1)
                           / math.sqrt(fan_in))
        self.bias = param((cout,), lambda: jnp.zeros((cout,)))
        self.stride = stride
        self.padding = padding

    def __call__(self, x: Array) -> Array:  # (B, H, W, Cin) -> (B, H', W', Cout)
        kernel = self.kernel.get_value()
        pointwise = self.kernel.shape[:2] == (1, 1) and self.stride == 1 and self.padding == 0
        if isinstance(kernel, Quantised) and pointwise:  # a 1x1 conv is a Linear on each pixel: scaled on the output
            y = kernel.matrix().product(x)  # (B, H, W, Cin) @ (Cin, Cout): one GEMM reading the stored values
        elif isinstance(kernel, Quantised):  # kxk: cuDNN reads a bf16 weight copy, where the scale costs nothing
            y = conv2d(x, kernel.expand(x.dtype), self.stride, self.padding)
        elif pointwise and is_low(kernel.dtype):  # fp8 left by storage.upcast: one GEMM reading it, as a Linear's
            y = conv2d(x, kernel.astype(x.dtype), 1, 0, impl="dot1x1")  # (B, H, W, Cin) @ (Cin, Cout)
        else:
            y = conv2d(x, kernel.astype(x.dtype), self.stride, self.padding)
        y = y + lift(self.bias[...].astype(x.dtype), y.ndim)
        lora = getattr(self, "lora", None)  # a 1x1 conv's low-rank adapter (preheat.models.adapters.attach)
        return y if lora is None else y + lora(x)


class Linear(nnx.Module):
    """``bias=False`` for torch's ``nn.Linear(..., bias=False)`` (e.g. cross-attention q/k/v)."""

    def __init__(self, cin: int, cout: int, *, bias: bool = True, rngs: nnx.Rngs):
        self.kernel = param((cin, cout), lambda: jax.random.uniform(rngs.params(), (cin, cout), minval=-1, maxval=1) / math.sqrt(cin))
        self.bias = param((cout,), lambda: jnp.zeros((cout,))) if bias else None

    def __call__(self, x: Array) -> Array:  # (..., Cin) -> (..., Cout)
        kernel = self.kernel.get_value()
        if isinstance(kernel, Quantised):  # stored values and a scale kept by storage.upcast: scaled on the output
            y = kernel.product(x)
        else:
            y = x @ kernel.astype(x.dtype)
        if self.bias is not None:
            y = y + lift(self.bias[...].astype(x.dtype), y.ndim)
        lora = getattr(self, "lora", None)  # a low-rank adapter set for one traced call (preheat.models.adapters.attach)
        return y if lora is None else y + lora(x)


class GroupNorm(nnx.Module):
    """GroupNorm over NHWC (or (B, L, C)); statistics in float32 whatever the activation dtype, in one
    or two passes (``preheat.models.conv.groupnorm_impl``)."""

    def __init__(self, groups: int, channels: int, eps: float):
        self.scale = param((channels,), lambda: jnp.ones((channels,)))
        self.bias = param((channels,), lambda: jnp.zeros((channels,)))
        self.groups = groups
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        shape = x.shape
        c = shape[-1]
        xg = x.astype(jnp.float32).reshape(shape[0], -1, self.groups, c // self.groups)  # (B, HW, G, C/G)
        if groupnorm_impl() == "one_pass":
            # (B, 1, G, 1): the group's mean over its first position, so E[d] is of the spread's size and
            # E[d^2] - E[d]^2 keeps the variance; a separate op (the barrier), so that the moments below
            # stay one fused reduction over xg (a slice of xg fused into it measured slower than two passes)
            shift = jax.lax.optimization_barrier(xg[:, :1].mean(axis=(1, 3), keepdims=True))
            d = xg - shift
            m1 = d.mean(axis=(1, 3), keepdims=True)  # both moments in one reduction over xg
            m2 = jnp.square(d).mean(axis=(1, 3), keepdims=True)
            inv = jax.lax.rsqrt(jnp.maximum(m2 - jnp.square(m1), 0.0) + self.eps)  # (B, 1, G, 1)
            gc = (1, 1, self.groups, c // self.groups)
            a = inv * self.scale[...].reshape(gc)  # (B, 1, G, C/G)
            b = self.bias[...].reshape(gc) - (shift + m1) * a
            return (xg * a + b).reshape(shape).astype(x.dtype)
        mean = xg.mean(axis=(1, 3), keepdims=True)
        var = jnp.square(xg - mean).mean(axis=(1, 3), keepdims=True)
        xg = (xg - mean) * jax.lax.rsqrt(var + self.eps)
        y = xg.reshape(shape) * lift(self.scale[...], len(shape)) + lift(self.bias[...], len(shape))
        return y.astype(x.dtype)


class LayerNorm(nnx.Module):
    """torch's ``nn.LayerNorm`` over the last axis; statistics in float32 whatever the activation dtype."""

    def __init__(self, dim: int, eps: float):
        self.scale = param((dim,), lambda: jnp.ones((dim,)))
        self.bias = param((dim,), lambda: jnp.zeros((dim,)))
        self.eps = eps

    def __call__(self, x: Array) -> Array:  # (..., D) -> (..., D)
        h = x.astype(jnp.float32)
        mean = h.mean(axis=-1, keepdims=True)
        var = jnp.square(h - mean).mean(axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        y = h * lift(self.scale[...].astype(jnp.float32), h.ndim) + lift(self.bias[...].astype(jnp.float32), h.ndim)
        return y.astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, num: int, dim: int, *, rngs: nnx.Rngs):
        self.embedding = param((num, dim), lambda: jax.random.normal(rngs.params(), (num, dim)))

    def __call__(self, ids: Array) -> Array:
        return jnp.take(self.embedding[...], ids, axis=0)


# ----------------------------------------------------------------------------------------------
# Time embeddings


def sinusoidal_embedding(t: Array, dim: int, flip_sin_to_cos: bool, freq_shift: float, max_period: float = 10000.0) -> Array:
    """Positional timestep features as diffusers computes them (float32). (B,) -> (B, dim)."""
    half = dim // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift)
    args = t.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]  # (B, half)
    emb = jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)
    if flip_sin_to_cos:
        emb = jnp.concatenate([emb[:, half:], emb[:, :half]], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


class GaussianFourierProjection(nnx.Module):
    """Fixed random Fourier features of log(sigma) (score-SDE style models)."""

    def __init__(self, size: int, *, rngs: nnx.Rngs):
        self.weight = param((size,), lambda: jax.random.normal(rngs.params(), (size,)) * 16.0)

    def __call__(self, t: Array) -> Array:  # (B,) -> (B, 2*size)
        proj = jnp.log(t.astype(jnp.float32))[:, None] * self.weight[...].astype(jnp.float32)[None, :] * 2 * math.pi
        return jnp.concatenate([jnp.sin(proj), jnp.cos(proj)], axis=-1)


class TimestepEmbedding(nnx.Module):
    def __init__(self, cin: int, dim: int, *, rngs: nnx.Rngs):
        self.linear_1 = Linear(cin, dim, rngs=rngs)
        self.linear_2 = Linear(dim, dim, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


# ----------------------------------------------------------------------------------------------
# Resnet, attention and resampling blocks


class ResnetBlock2D(nnx.Module):
    """Two GroupNorm-act-conv stages with a residual; ``temb=None`` builds it without a time input
    (no ``time_emb_proj``), as diffusers does for the VAE's encoder and decoder."""

    def __init__(self, cin: int, cout: int, temb: int | None, *, groups: int, eps: float, act: str,
                 scale_shift: bool, output_scale_factor: float, rngs: nnx.Rngs):
        self.norm1 = GroupNorm(groups, cin, eps)
        self.conv1 = Conv2d(cin, cout, 3, padding=1, rngs=rngs)
        self.time_emb_proj = None if temb is None else Linear(temb, 2 * cout if scale_shift else cout, rngs=rngs)
        self.norm2 = GroupNorm(groups, cout, eps)
        self.conv2 = Conv2d(cout, cout, 3, padding=1, rngs=rngs)
        self.conv_shortcut = Conv2d(cin, cout, 1, rngs=rngs) if cin != cout else None
        self.act = activation(act)
        self.scale_shift = scale_shift
        self.output_scale_factor = output_scale_factor

    def __call__(self, x: Array, temb: Array | None = None) -> Array:  # (B,H,W,Cin), (B,T) -> (B,H,W,Cout)
        h = self.conv1(self.act(self.norm1(x)))
        if self.time_emb_proj is None:
            h = self.norm2(h)
        elif temb is None:
            raise InvalidArgumentError("this ResnetBlock2D has a time_emb_proj: pass temb", argument="temb")
        elif self.scale_shift:
            t = self.time_emb_proj(self.act(temb))[:, None, None, :]  # (B,1,1,2C)
            scale, shift = jnp.split(t, 2, axis=-1)
            h = self.norm2(h) * (1 + scale) + shift
        else:
            h = self.norm2(h + self.time_emb_proj(self.act(temb))[:, None, None, :])  # + (B,1,1,C)
        h = self.conv2(self.act(h))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return (x + h) / self.output_scale_factor


class Attention(nnx.Module):
    """Spatial self-attention with residual (diffusers' Attention as used by UNet2DModel's blocks)."""

    def __init__(self, channels: int, head_dim: int | None, *, groups: int | None, eps: float,
                 rescale_output_factor: float, rngs: nnx.Rngs):
        head_dim = head_dim if head_dim is not None else channels
        self.heads = channels // head_dim
        self.head_dim = head_dim
        self.group_norm = GroupNorm(groups, channels, eps) if groups is not None else None
        self.to_q = Linear(channels, self.heads * head_dim, rngs=rngs)
        self.to_k = Linear(channels, self.heads * head_dim, rngs=rngs)
        self.to_v = Linear(channels, self.heads * head_dim, rngs=rngs)
        self.to_out = nnx.List([Linear(self.heads * head_dim, channels, rngs=rngs)])
        self.rescale_output_factor = rescale_output_factor

    def __call__(self, x: Array) -> Array:  # (B, H, W, C) -> (B, H, W, C)
        b, hgt, wid, c = x.shape
        h = x.reshape(b, hgt * wid, c)  # (B, L, C)
        if self.group_norm is not None:
            h = self.group_norm(h)

        def heads(y: Array) -> Array:  # (B, L, nH*D) -> (B, L, nH, D)
            return y.reshape(b, hgt * wid, self.heads, self.head_dim)

        q, k, v = heads(self.to_q(h)), heads(self.to_k(h)), heads(self.to_v(h))
        logits = jnp.einsum("blhd,bmhd->bhlm", q, k).astype(jnp.float32) / math.sqrt(self.head_dim)
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # (B, nH, L, L)
        out = jnp.einsum("bhlm,bmhd->blhd", weights, v).reshape(b, hgt * wid, self.heads * self.head_dim)
        out = self.to_out[0](out).reshape(b, hgt, wid, c)
        return (out + x) / self.rescale_output_factor


class Downsample2D(nnx.Module):
    def __init__(self, channels: int, padding: int, *, rngs: nnx.Rngs):
        self.conv = Conv2d(channels, channels, 3, stride=2, padding=padding, rngs=rngs)
        self.asymmetric = padding == 0  # diffusers pads right/bottom by one, then convolves unpadded

    def __call__(self, x: Array) -> Array:
        if self.asymmetric:
            x = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))
        return self.conv(x)


class Upsample2D(nnx.Module):
    def __init__(self, channels: int, *, rngs: nnx.Rngs):
        self.conv = Conv2d(channels, channels, 3, padding=1, rngs=rngs)

    def __call__(self, x: Array, size: tuple[int, int] | None = None) -> Array:
        """Nearest-neighbour x2 (or to ``size``, diffusers' ``upsample_size``), then 3x3 conv."""
        h, w = x.shape[1:3]
        if size is None or tuple(size) == (2 * h, 2 * w):
            x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        else:
            x = jnp.take(jnp.take(x, nearest_index(h, size[0]), axis=1), nearest_index(w, size[1]), axis=2)
        return self.conv(x)


def nearest_index(n_in: int, n_out: int) -> np.ndarray:
    """torch's ``nearest`` source indices: floor(i * (in / out)), the scale in float32."""
    scale = np.float32(n_in) / np.float32(n_out)
    return np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * scale), n_in - 1).astype(np.int32)
