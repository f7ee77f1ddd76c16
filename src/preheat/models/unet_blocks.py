"""The UNet's down, up and mid blocks (diffusers' ``DownBlock2D`` / ``AttnDownBlock2D``,
``UpBlock2D`` / ``AttnUpBlock2D``, ``UNetMidBlock2D``), shared by ``UNet2DModel`` and the VAE's
encoder and decoder (whose resnets take no time embedding)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from preheat.models.layers import Attention, Downsample2D, ResnetBlock2D, Upsample2D

__all__ = ["BlockSpec", "DownBlock", "UpBlock", "MidBlock"]

Array = jax.Array


@dataclass(frozen=True)
class BlockSpec:
    groups: int
    eps: float
    act: str
    scale_shift: bool
    temb: int | None  # None: resnets without a time embedding (the VAE)


class DownBlock(nnx.Module):
    """DownBlock2D / AttnDownBlock2D: resnets (+ attention each), then an optional downsampler."""

    def __init__(self, cin: int, cout: int, layers: int, attention: bool, head_dim: int | None,
                 downsample: bool, padding: int, s: BlockSpec, *, rngs: nnx.Rngs):
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
                 upsample: bool, s: BlockSpec, *, rngs: nnx.Rngs):
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
                 scale: float, s: BlockSpec, *, rngs: nnx.Rngs):
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
