"""Diffusers' ``UNet2DModel`` in JAX (Flax NNX), numerically matching the torch original.

Layout: NHWC inside (XLA's preferred layout on GPU and CPU); the public ``LoadedUNet2D.__call__``
takes and returns NCHW like diffusers, and transposes at the edges. Parameters are stored in
the layout the math wants (conv kernels HWIO, linear kernels (in, out)); ``preheat.models.loading``
converts diffusers' torch-layout tensors on load.

Every submodule is named exactly like its diffusers counterpart (``down_blocks.0.resnets.1.conv1``)
so that the parameter path of a leaf *is* the checkpoint key, modulo the leaf name:

    kernel -> weight (transposed), bias -> bias, scale -> weight, embedding -> weight, weight -> weight

Weights are never closed over: ``LoadedUNet2D.apply(params, ...)`` is a pure function of its arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preheat.errors import InvalidArgumentError, UnsupportedConfigError
from preheat.models.conv import conv2d, groupnorm_impl
from preheat.models.weights import param

__all__ = ["UNet2DConfig", "UNet2DModel", "SUPPORTED", "LayerNorm", "JsonConfig"]

Array = jax.Array

# Everything published UNet2DModel checkpoints use. Anything else is refused by name.
SUPPORTED: dict[str, tuple[Any, ...]] = {
    "down_block_types": ("DownBlock2D", "AttnDownBlock2D"),
    "up_block_types": ("UpBlock2D", "AttnUpBlock2D"),
    "mid_block_type": ("UNetMidBlock2D", None),
    "time_embedding_type": ("positional", "fourier"),
    "resnet_time_scale_shift": ("default", "scale_shift"),
    "act_fn": ("silu", "swish", "mish", "gelu", "relu"),
    "class_embed_type": (None, "timestep", "identity"),
    "downsample_type": ("conv",),
    "upsample_type": ("conv",),
}

# Config keys that do not change inference math (or are bookkeeping) and are accepted as-is.
_IGNORED_KEYS = {"sample_size", "dropout", "num_train_timesteps"}


class JsonConfig:
    """Mixin for config dataclasses: ``to_dict`` gives diffusers' JSON shape (tuples as lists)."""

    @classmethod
    def from_checked_dict(cls, raw: Any, source: str, class_name: str) -> Any:
        """A config from diffusers' ``config.json``: another ``_class_name`` or a key this dataclass
        does not know is refused by name in one line; JSON lists become tuples; then ``validate``."""
        name = raw.get("_class_name", class_name)
        if name != class_name:
            raise UnsupportedConfigError(f"unsupported model class {name!r} in {source}; supported: {class_name!r}")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(k for k in raw if not k.startswith("_") and k not in known)
        if unknown:
            raise UnsupportedConfigError(
                f"unsupported {class_name} config key(s) {', '.join(unknown)} in {source}; "
                f"supported keys: {', '.join(sorted(known))}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in known}
        config = cls(**values)
        config.validate(source)  # type: ignore[attr-defined]
        return config

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class UNet2DConfig(JsonConfig):
    """The architecture, parsed from diffusers' ``config.json`` (same names, same defaults)."""

    sample_size: int | tuple[int, int] | None = None  # native resolution; not needed for the math
    in_channels: int = 3
    out_channels: int = 3
    center_input_sample: bool = False  # map [0,1] inputs to [-1,1] first
    time_embedding_type: str = "positional"
    time_embedding_dim: int | None = None  # default: 4 * block_out_channels[0]
    freq_shift: int = 0
    flip_sin_to_cos: bool = True
    down_block_types: tuple[str, ...] = ("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D")
    mid_block_type: str | None = "UNetMidBlock2D"
    up_block_types: tuple[str, ...] = ("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D")
    block_out_channels: tuple[int, ...] = (224, 448, 672, 896)
    layers_per_block: int = 2
    mid_block_scale_factor: float = 1.0
    downsample_padding: int = 1
    downsample_type: str = "conv"
    upsample_type: str = "conv"
    dropout: float = 0.0  # training only
    act_fn: str = "silu"
    attention_head_dim: int | None = 8  # None: one head spanning all channels
    norm_num_groups: int = 32
    attn_norm_num_groups: int | None = None  # mid-block attention groups; None: see mid block
    norm_eps: float = 1e-5
    resnet_time_scale_shift: str = "default"
    add_attention: bool = True  # mid-block attention on/off
    class_embed_type: str | None = None
    num_class_embeds: int | None = None
    num_train_timesteps: int | None = None  # only used by the (unsupported) "learned" embedding

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "UNet2DConfig":
        return cls.from_checked_dict(raw, source, "UNet2DModel")

    def architecture_dict(self) -> dict[str, Any]:
        """The fields that change the program (for cache keys): everything but bookkeeping."""
        return {k: v for k, v in self.to_dict().items() if k not in _IGNORED_KEYS}

    def validate(self, source: str = "config") -> None:
        def refuse(name: str, value: Any) -> None:
            allowed = ", ".join(repr(v) for v in SUPPORTED[name])
            raise UnsupportedConfigError(f"unsupported {name} {value!r}; supported: {allowed} (in {source})")

        for name in ("down_block_types", "up_block_types"):
            for block in getattr(self, name):
                if block not in SUPPORTED[name]:
                    refuse(name, block)
        for name in ("mid_block_type", "time_embedding_type", "resnet_time_scale_shift", "class_embed_type",
                     "downsample_type", "upsample_type"):
            if getattr(self, name) not in SUPPORTED[name]:
                refuse(name, getattr(self, name))
        if self.act_fn.lower() not in SUPPORTED["act_fn"]:
            refuse("act_fn", self.act_fn)
        n = len(self.block_out_channels)
        if len(self.down_block_types) != n or len(self.up_block_types) != n:
            raise UnsupportedConfigError(
                f"block_out_channels has {n} entries but down_block_types has {len(self.down_block_types)} "
                f"and up_block_types {len(self.up_block_types)}; they must be equal"
            )
        if not isinstance(self.norm_num_groups, int) or self.norm_num_groups <= 0:
            raise UnsupportedConfigError(f"unsupported norm_num_groups {self.norm_num_groups!r}; must be a positive int")
        for ch in self.block_out_channels:
            if ch % self.norm_num_groups:
                raise UnsupportedConfigError(
                    f"block_out_channels entry {ch} is not divisible by norm_num_groups {self.norm_num_groups}"
                )
        if self.downsample_padding not in (0, 1):
            raise UnsupportedConfigError(f"unsupported downsample_padding {self.downsample_padding!r}; supported: 0, 1")
        if self.class_embed_type is None and self.num_class_embeds is not None and self.num_class_embeds <= 0:
            raise UnsupportedConfigError(f"num_class_embeds must be positive, got {self.num_class_embeds}")

    @property
    def time_embed_dim(self) -> int:
        return self.time_embedding_dim or self.block_out_channels[0] * 4

    @property
    def is_class_conditional(self) -> bool:
        return self.class_embed_type is not None or self.num_class_embeds is not None


# ----------------------------------------------------------------------------------------------
# Leaf layers. Initialisers matter only for training (train-digits); loading never runs them
# because the model is built abstractly (``weights.build_abstract``: ``param`` makes shapes only)
# and then filled.


def _activation(name: str) -> Callable[[Array], Array]:
    name = name.lower()
    return {
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
        "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "relu": jax.nn.relu,
    }[name]


def _lift(v: Array, ndim: int) -> Array:
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
        y = conv2d(x, self.kernel[...].astype(x.dtype), self.stride, self.padding)
        y = y + _lift(self.bias[...].astype(x.dtype), y.ndim)
        lora = getattr(self, "lora", None)  # a 1x1 conv's low-rank adapter (preheat.models.lora.attach)
        return y if lora is None else y + lora(x)


class Linear(nnx.Module):
    """``bias=False`` for torch's ``nn.Linear(..., bias=False)`` (e.g. cross-attention q/k/v)."""

    def __init__(self, cin: int, cout: int, *, bias: bool = True, rngs: nnx.Rngs):
        self.kernel = param((cin, cout), lambda: jax.random.uniform(rngs.params(), (cin, cout), minval=-1, maxval=1) / math.sqrt(cin))
        self.bias = param((cout,), lambda: jnp.zeros((cout,))) if bias else None

    def __call__(self, x: Array) -> Array:  # (..., Cin) -> (..., Cout)
        y = x @ self.kernel[...].astype(x.dtype)
        if self.bias is not None:
            y = y + _lift(self.bias[...].astype(x.dtype), y.ndim)
        lora = getattr(self, "lora", None)  # a low-rank adapter set for one traced call (preheat.models.lora.attach)
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
        y = xg.reshape(shape) * _lift(self.scale[...], len(shape)) + _lift(self.bias[...], len(shape))
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
        y = h * _lift(self.scale[...].astype(jnp.float32), h.ndim) + _lift(self.bias[...].astype(jnp.float32), h.ndim)
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
# Blocks


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
        self.act = _activation(act)
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
            x = jnp.take(jnp.take(x, _nearest_index(h, size[0]), axis=1), _nearest_index(w, size[1]), axis=2)
        return self.conv(x)


def _nearest_index(n_in: int, n_out: int) -> np.ndarray:
    """torch's ``nearest`` source indices: floor(i * (in / out)), the scale in float32."""
    scale = np.float32(n_in) / np.float32(n_out)
    return np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * scale), n_in - 1).astype(np.int32)


@dataclass(frozen=True)
class _BlockSpec:
    groups: int
    eps: float
    act: str
    scale_shift: bool
    temb: int | None  # None: resnets without a time embedding (the VAE)


class DownBlock(nnx.Module):
    """DownBlock2D / AttnDownBlock2D: resnets (+ attention each), then an optional downsampler."""

    def __init__(self, cin: int, cout: int, layers: int, attention: bool, head_dim: int | None,
                 downsample: bool, padding: int, s: _BlockSpec, *, rngs: nnx.Rngs):
        self.resnets = nnx.List([
            ResnetBlock2D(cin if i == 0 else cout, cout, s.temb, groups=s.groups, eps=s.eps, act=s.act,
                          scale_shift=s.scale_shift, output_scale_factor=1.0, rngs=rngs)
            for i in range(layers)
        ])
        self.attentions = nnx.List([
            Attention(cout, head_dim, groups=s.groups, eps=s.eps, rescale_output_factor=1.0, rngs=rngs)
            for _ in range(layers)
        ]) if attention else None
        self.downsamplers = nnx.List([Downsample2D(cout, padding, rngs=rngs)]) if downsample else None

    def __call__(self, x: Array, temb: Array | None = None) -> tuple[Array, list[Array]]:
        skips = []
        for i, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[i](x)
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, skips


class UpBlock(nnx.Module):
    """UpBlock2D / AttnUpBlock2D: each resnet eats one skip connection (channel concat)."""

    def __init__(self, cin: int, prev: int, cout: int, layers: int, attention: bool, head_dim: int | None,
                 upsample: bool, s: _BlockSpec, *, rngs: nnx.Rngs):
        def resnet_in(i: int) -> int:
            skip = cin if i == layers - 1 else cout
            return (prev if i == 0 else cout) + skip

        self.resnets = nnx.List([
            ResnetBlock2D(resnet_in(i), cout, s.temb, groups=s.groups, eps=s.eps, act=s.act,
                          scale_shift=s.scale_shift, output_scale_factor=1.0, rngs=rngs)
            for i in range(layers)
        ])
        self.attentions = nnx.List([
            Attention(cout, head_dim, groups=s.groups, eps=s.eps, rescale_output_factor=1.0, rngs=rngs)
            for _ in range(layers)
        ]) if attention else None
        self.upsamplers = nnx.List([Upsample2D(cout, rngs=rngs)]) if upsample else None

    def __call__(self, x: Array, skips: list[Array], temb: Array) -> Array:
        for i, resnet in enumerate(self.resnets):
            x = jnp.concatenate([x, skips.pop()], axis=-1)  # (B, H, W, C + Cskip)
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[i](x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class MidBlock(nnx.Module):
    """UNetMidBlock2D: resnet, (attention, resnet)."""

    def __init__(self, channels: int, head_dim: int | None, attention: bool, attn_groups: int | None,
                 scale: float, s: _BlockSpec, *, rngs: nnx.Rngs):
        def resnet() -> ResnetBlock2D:
            return ResnetBlock2D(channels, channels, s.temb, groups=s.groups, eps=s.eps, act=s.act,
                                 scale_shift=s.scale_shift, output_scale_factor=scale, rngs=rngs)

        self.resnets = nnx.List([resnet(), resnet()])
        self.attentions = nnx.List([
            Attention(channels, head_dim, groups=attn_groups, eps=s.eps, rescale_output_factor=scale, rngs=rngs)
        ]) if attention else None

    def __call__(self, x: Array, temb: Array | None = None) -> Array:
        x = self.resnets[0](x, temb)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x, temb)


# ----------------------------------------------------------------------------------------------


class UNet2DModule(nnx.Module):
    """diffusers' ``UNet2DModel`` as a Flax NNX module (the network; ``__call__`` is NHWC). See
    ``preheat.models.loading.LoadedUNet2D`` for the loaded weights with the NCHW-facing call."""

    def __init__(self, config: UNet2DConfig, *, rngs: nnx.Rngs):
        c = config
        config.validate()
        self.config = c
        ch0 = c.block_out_channels[0]
        tdim = c.time_embed_dim
        self.conv_in = Conv2d(c.in_channels, ch0, 3, padding=1, rngs=rngs)
        if c.time_embedding_type == "fourier":
            self.time_proj = GaussianFourierProjection(ch0, rngs=rngs)
            t_in = 2 * ch0
        else:
            self.time_proj = None  # sinusoidal features have no weights
            t_in = ch0
        self.time_embedding = TimestepEmbedding(t_in, tdim, rngs=rngs)
        if c.class_embed_type is None and c.num_class_embeds is not None:
            self.class_embedding = Embedding(c.num_class_embeds, tdim, rngs=rngs)
        elif c.class_embed_type == "timestep":
            self.class_embedding = TimestepEmbedding(t_in, tdim, rngs=rngs)
        else:
            self.class_embedding = None  # None or "identity": labels are added as they are

        spec = _BlockSpec(c.norm_num_groups, c.norm_eps, c.act_fn, c.resnet_time_scale_shift == "scale_shift", tdim)
        chans = c.block_out_channels
        n = len(chans)
        down = []
        out_ch = chans[0]
        for i, kind in enumerate(c.down_block_types):
            in_ch, out_ch = out_ch, chans[i]
            head = c.attention_head_dim if c.attention_head_dim is not None else out_ch
            down.append(DownBlock(in_ch, out_ch, c.layers_per_block, kind == "AttnDownBlock2D", head,
                                  i < n - 1, c.downsample_padding, spec, rngs=rngs))
        self.down_blocks = nnx.List(down)

        if c.mid_block_type is not None:
            attn_groups = c.attn_norm_num_groups
            if attn_groups is None and not spec.scale_shift:
                attn_groups = c.norm_num_groups  # diffusers: no attention norm with scale_shift unless given
            head = c.attention_head_dim if c.attention_head_dim is not None else chans[-1]
            self.mid_block = MidBlock(chans[-1], head, c.add_attention, attn_groups, c.mid_block_scale_factor,
                                      spec, rngs=rngs)
        else:
            self.mid_block = None

        rev = list(reversed(chans))
        up = []
        out_ch = rev[0]
        for i, kind in enumerate(c.up_block_types):
            prev, out_ch = out_ch, rev[i]
            in_ch = rev[min(i + 1, n - 1)]
            head = c.attention_head_dim if c.attention_head_dim is not None else out_ch
            up.append(UpBlock(in_ch, prev, out_ch, c.layers_per_block + 1, kind == "AttnUpBlock2D", head,
                              i < n - 1, spec, rngs=rngs))
        self.up_blocks = nnx.List(up)

        self.conv_norm_out = GroupNorm(c.norm_num_groups, ch0, c.norm_eps)
        self.conv_out = Conv2d(ch0, c.out_channels, 3, padding=1, rngs=rngs)

    def __call__(self, x: Array, t: Array, class_labels: Array | None = None) -> Array:
        """(B, H, W, Cin), (B,) timesteps, (B,) labels -> (B, H, W, Cout)."""
        c = self.config
        dtype = x.dtype
        if c.center_input_sample:
            x = 2 * x - 1.0
        t = jnp.broadcast_to(jnp.asarray(t), (x.shape[0],))
        if self.time_proj is not None:
            t_feat = self.time_proj(t)
        else:
            t_feat = sinusoidal_embedding(t, c.block_out_channels[0], c.flip_sin_to_cos, c.freq_shift)
        emb = self.time_embedding(t_feat.astype(dtype))  # (B, T)
        if c.is_class_conditional:
            if class_labels is None:
                raise InvalidArgumentError("this UNet is class-conditional: pass class_labels", argument="class_labels")
            if c.class_embed_type == "timestep":
                y_feat = self.time_proj(class_labels) if self.time_proj is not None else sinusoidal_embedding(
                    class_labels, c.block_out_channels[0], c.flip_sin_to_cos, c.freq_shift)
                emb = emb + self.class_embedding(y_feat.astype(dtype))
            elif c.class_embed_type == "identity":
                emb = emb + class_labels.astype(dtype)
            else:
                emb = emb + self.class_embedding(class_labels).astype(dtype)

        h = self.conv_in(x)
        skips = [h]
        for block in self.down_blocks:
            h, res = block(h, emb)
            skips.extend(res)
        if self.mid_block is not None:
            h = self.mid_block(h, emb)
        for block in self.up_blocks:
            h = block(h, skips, emb)
        h = self.conv_out(jax.nn.silu(self.conv_norm_out(h)))
        if c.time_embedding_type == "fourier":
            h = h / t.astype(h.dtype)[:, None, None, None]
        return h
