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

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from preheat.errors import InvalidArgumentError, UnsupportedConfigError
from preheat.models.config import JsonConfig
from preheat.models.layers import (Conv2d, Embedding, GaussianFourierProjection, GroupNorm, TimestepEmbedding,
                                   sinusoidal_embedding)
from preheat.models.unet_blocks import BlockSpec, DownBlock, MidBlock, UpBlock

__all__ = ["UNet2DConfig", "UNet2DModule", "SUPPORTED"]

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

        spec = BlockSpec(c.norm_num_groups, c.norm_eps, c.act_fn, c.resnet_time_scale_shift == "scale_shift", tdim)
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
