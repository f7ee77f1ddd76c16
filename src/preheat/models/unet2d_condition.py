"""Diffusers' ``UNet2DConditionModel`` (Stable Diffusion 1.x / 2.x, SDXL) in JAX (Flax NNX).

The text-conditioned UNet: ResNet blocks as in ``preheat.models.unet2d`` (reused, not copied),
plus ``Transformer2DModel`` blocks (``preheat.models.transformer2d``) whose ``BasicTransformerBlock`` runs self-attention,
cross-attention on the text encoder's hidden states, and a GEGLU feed-forward. SDXL adds a
"text_time" embedding (pooled text embedding + sinusoidal features of its size/crop ids).

As in ``unet2d``: NHWC inside, every submodule named exactly like diffusers' so that a parameter
path *is* its checkpoint key (``down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k``),
built abstractly and filled from safetensors, weights passed as an argument (``apply``).
Attention goes through ``jax.nn.dot_product_attention`` so that GPUs with cuDNN get fused attention.

diffusers' head-count naming, reproduced: ``attention_head_dim`` in a config is (for historical
reasons) the number of heads per block, unless ``num_attention_heads`` is given; each block's head
width is then ``block_out_channels[i] // heads[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from preheat.errors import InvalidArgumentError, ModelFormatError, UnsupportedConfigError
from preheat.models import weights
from preheat.models.folders import resolve_unet_dir
from preheat.models.transformer2d import Transformer2DModel
from preheat.models.config import JsonConfig
from preheat.models.layers import (Conv2d, Downsample2D, GroupNorm, ResnetBlock2D, TimestepEmbedding, Upsample2D,
                                   activation, sinusoidal_embedding)
from preheat.models.stacking import scanned, stack
from preheat.models.storage import layerwise, upcast
from preheat.models.safetensors_files import DIFFUSERS_STEM, read_json, read_tensors, weight_files
from preheat.models.weights import LoadOptions, check_dtype, fill

__all__ = [
    "UNet2DConditionConfig",
    "UNet2DConditionModule",
    "DownHalf",
    "Residuals",
    "SUPPORTED",
    "load_unet_condition",
    "read_unet_condition_config",
    "build_abstract",
    "build_unet_condition",
    "check_text_conditioning",
    "check_unet_inputs",
]

Array = jax.Array

# Everything SD 1.x, SD 2.x and SDXL checkpoints use. Any other value is refused by name.
SUPPORTED: dict[str, tuple[Any, ...]] = {
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    "mid_block_type": ("UNetMidBlock2DCrossAttn", None),
    "addition_embed_type": (None, "text_time"),
    "class_embed_type": (None,),
    "num_class_embeds": (None,),
    "time_embedding_type": ("positional",),
    "resnet_time_scale_shift": ("default",),
    "act_fn": ("silu", "swish"),
    "only_cross_attention": (False,),
    "mid_block_only_cross_attention": (None, False),
    "dual_cross_attention": (False,),
    "encoder_hid_dim": (None,),
    "encoder_hid_dim_type": (None,),
    "time_embedding_act_fn": (None,),
    "timestep_post_act": (None,),
    "time_cond_proj_dim": (None,),
    "conv_in_kernel": (3,),
    "conv_out_kernel": (3,),
    "attention_type": ("default",),
    "class_embeddings_concat": (False,),
    "cross_attention_norm": (None,),
    "resnet_skip_time_act": (False,),
    "resnet_out_scale_factor": (1.0,),
    "reverse_transformer_layers_per_block": (None,),
}

# Config keys that do not change inference math (bookkeeping, training, or used only by
# unsupported options) and are accepted as they are.
_IGNORED_KEYS = {"sample_size", "dropout", "addition_embed_type_num_heads"}


@dataclass(frozen=True)
class UNet2DConditionConfig(JsonConfig):
    """The architecture, parsed from diffusers' ``config.json`` (same names, same defaults)."""

    sample_size: int | tuple[int, int] | None = None  # native latent size; not needed for the math
    in_channels: int = 4
    out_channels: int = 4
    center_input_sample: bool = False  # map [0,1] inputs to [-1,1] first
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple[str, ...] = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                         "DownBlock2D")
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    up_block_types: tuple[str, ...] = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int | tuple[int, ...] = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    dropout: float = 0.0  # training only
    act_fn: str = "silu"
    norm_num_groups: int | None = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int | tuple[int, ...] = 1280  # width of the text encoder's hidden states
    transformer_layers_per_block: int | tuple[int, ...] = 1  # BasicTransformerBlocks per Transformer2DModel
    reverse_transformer_layers_per_block: Any = None
    encoder_hid_dim: int | None = None
    encoder_hid_dim_type: str | None = None
    attention_head_dim: int | tuple[int, ...] = 8  # the number of heads (diffusers' naming), per block
    num_attention_heads: int | tuple[int, ...] | None = None  # if given, the number of heads instead
    dual_cross_attention: bool = False
    use_linear_projection: bool = False  # proj_in/proj_out: Linear (SD 2.x, SDXL) or 1x1 Conv2d (SD 1.x)
    class_embed_type: str | None = None
    addition_embed_type: str | None = None  # "text_time": SDXL's pooled text + size/crop ids
    addition_time_embed_dim: int | None = None  # sinusoidal width per SDXL time id
    num_class_embeds: int | None = None
    upcast_attention: bool | None = False  # attention in float32 whatever the activation dtype
    resnet_time_scale_shift: str = "default"
    resnet_skip_time_act: bool = False
    resnet_out_scale_factor: float = 1.0
    time_embedding_type: str = "positional"
    time_embedding_dim: int | None = None  # default: 4 * block_out_channels[0]
    time_embedding_act_fn: str | None = None
    timestep_post_act: str | None = None
    time_cond_proj_dim: int | None = None
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3
    projection_class_embeddings_input_dim: int | None = None  # "text_time": pooled width + n_ids * time dim
    attention_type: str = "default"
    class_embeddings_concat: bool = False
    mid_block_only_cross_attention: bool | None = None
    cross_attention_norm: str | None = None
    addition_embed_type_num_heads: int = 64  # used only by addition_embed_type "text" (unsupported)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "UNet2DConditionConfig":
        return cls.from_checked_dict(raw, source, "UNet2DConditionModel")

    def architecture_dict(self) -> dict[str, Any]:
        """The fields that change the program (for cache keys): everything but bookkeeping."""
        return {k: v for k, v in self.to_dict().items() if k not in _IGNORED_KEYS}

    # -- resolved per-block values (diffusers' __init__ does the same expansion) ---------------

    def _per_block(self, name: str, value: Any) -> tuple[Any, ...]:
        n = len(self.down_block_types)
        if isinstance(value, (tuple, list)):
            if len(value) != n:
                raise UnsupportedConfigError(
                    f"{name} has {len(value)} entries but down_block_types has {n}; they must be equal")
            return tuple(value)
        return (value,) * n

    @property
    def heads(self) -> tuple[int, ...]:
        """Attention heads per down block: ``num_attention_heads or attention_head_dim`` (diffusers)."""
        if self.num_attention_heads:
            return self._per_block("num_attention_heads", self.num_attention_heads)
        return self._per_block("attention_head_dim", self.attention_head_dim)

    @property
    def layers(self) -> tuple[int, ...]:
        return self._per_block("layers_per_block", self.layers_per_block)

    @property
    def transformer_layers(self) -> tuple[int, ...]:
        return self._per_block("transformer_layers_per_block", self.transformer_layers_per_block)

    @property
    def time_embed_dim(self) -> int:
        return self.time_embedding_dim or self.block_out_channels[0] * 4

    def validate(self, source: str = "config") -> None:
        def refuse(name: str, value: Any) -> None:
            allowed = ", ".join(repr(v) for v in SUPPORTED[name])
            raise UnsupportedConfigError(f"unsupported UNet2DConditionModel {name} {value!r} in {source}; "
                                         f"supported: {allowed}")

        for name in ("down_block_types", "up_block_types"):
            for block in getattr(self, name):
                if block not in SUPPORTED[name]:
                    refuse(name, block)
        for name in SUPPORTED:
            if name in ("down_block_types", "up_block_types", "act_fn"):
                continue
            value = getattr(self, name)
            if name == "only_cross_attention" and isinstance(value, tuple):
                for v in value:
                    if v not in SUPPORTED[name]:
                        refuse(name, v)
            elif value not in SUPPORTED[name]:
                refuse(name, value)
        if self.act_fn.lower() not in SUPPORTED["act_fn"]:
            refuse("act_fn", self.act_fn)
        n = len(self.block_out_channels)
        if len(self.down_block_types) != n or len(self.up_block_types) != n:
            raise UnsupportedConfigError(
                f"block_out_channels has {n} entries but down_block_types has {len(self.down_block_types)} "
                f"and up_block_types {len(self.up_block_types)}; they must be equal")
        if not isinstance(self.cross_attention_dim, int) or self.cross_attention_dim <= 0:
            raise UnsupportedConfigError(
                f"unsupported cross_attention_dim {self.cross_attention_dim!r}; supported: one positive int")
        if not isinstance(self.norm_num_groups, int) or self.norm_num_groups <= 0:
            raise UnsupportedConfigError(f"unsupported norm_num_groups {self.norm_num_groups!r}; must be a positive int")
        for ch in self.block_out_channels:
            if ch % self.norm_num_groups:
                raise UnsupportedConfigError(
                    f"block_out_channels entry {ch} is not divisible by norm_num_groups {self.norm_num_groups}")
        if self.downsample_padding not in (0, 1):
            raise UnsupportedConfigError(f"unsupported downsample_padding {self.downsample_padding!r}; supported: 0, 1")
        for name, values in (("attention_head_dim / num_attention_heads", self.heads), ("layers_per_block", self.layers),
                             ("transformer_layers_per_block", self.transformer_layers)):
            for v in values:
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise UnsupportedConfigError(f"unsupported {name} entry {v!r}; must be a positive int per block")
        for ch, h in zip(self.block_out_channels, self.heads):
            if ch < h:  # head width is ch // h, as in diffusers (inner width heads * (ch // h) may be < ch)
                raise UnsupportedConfigError(f"block_out_channels entry {ch} is smaller than its {h} attention heads")
        if self.addition_embed_type == "text_time":
            for name in ("addition_time_embed_dim", "projection_class_embeddings_input_dim"):
                value = getattr(self, name)
                if not isinstance(value, int) or value <= 0:
                    raise UnsupportedConfigError(
                        f"addition_embed_type 'text_time' needs a positive int {name}, got {value!r}")

    @property
    def upcast(self) -> bool:
        return bool(self.upcast_attention)


# ----------------------------------------------------------------------------------------------
# UNet blocks


@dataclass(frozen=True)
class _Spec:
    """What every block of one UNet shares."""

    groups: int
    eps: float
    act: str
    temb: int
    context_dim: int
    linear: bool
    upcast: bool
    stacked: bool = False  # deep transformer stages as one scanned BlockStack (preheat.models.stacking)

    def resnet(self, cin: int, cout: int, scale: float, rngs: nnx.Rngs) -> ResnetBlock2D:
        return ResnetBlock2D(cin, cout, self.temb, groups=self.groups, eps=self.eps, act=self.act, scale_shift=False,
                             output_scale_factor=scale, rngs=rngs)

    def transformer(self, channels: int, heads: int, layers: int, rngs: nnx.Rngs) -> Transformer2DModel:
        return Transformer2DModel(channels, heads, layers, self.context_dim, self.groups, self.linear, self.upcast,
                                  rngs=rngs, stacked=self.stacked)


class DownBlock(nnx.Module):
    """CrossAttnDownBlock2D (resnet then transformer, per layer) or DownBlock2D (resnets only)."""

    def __init__(self, cin: int, cout: int, layers: int, cross_attention: bool, heads: int, t_layers: int,
                 downsample: bool, padding: int, s: _Spec, *, rngs: nnx.Rngs):
        self.resnets = nnx.List([s.resnet(cin if i == 0 else cout, cout, 1.0, rngs) for i in range(layers)])
        self.attentions = nnx.List([
            s.transformer(cout, heads, t_layers, rngs) for _ in range(layers)
        ]) if cross_attention else None
        self.downsamplers = nnx.List([Downsample2D(cout, padding, rngs=rngs)]) if downsample else None

    def __call__(self, x: Array, temb: Array, context: Array) -> tuple[Array, list[Array]]:
        skips = []
        for i, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[i](x, context)
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, skips


class UpBlock(nnx.Module):
    """CrossAttnUpBlock2D or UpBlock2D: each resnet eats one skip (channel concat)."""

    def __init__(self, cin: int, prev: int, cout: int, layers: int, cross_attention: bool, heads: int, t_layers: int,
                 upsample: bool, s: _Spec, *, rngs: nnx.Rngs):
        def resnet_in(i: int) -> int:
            skip = cin if i == layers - 1 else cout
            return (prev if i == 0 else cout) + skip

        self.resnets = nnx.List([s.resnet(resnet_in(i), cout, 1.0, rngs) for i in range(layers)])
        self.attentions = nnx.List([
            s.transformer(cout, heads, t_layers, rngs) for _ in range(layers)
        ]) if cross_attention else None
        self.upsamplers = nnx.List([Upsample2D(cout, rngs=rngs)]) if upsample else None

    def __call__(self, x: Array, skips: list[Array], temb: Array, context: Array) -> Array:
        for i, resnet in enumerate(self.resnets):
            x = jnp.concatenate([x, skips.pop()], axis=-1)  # (B, H, W, C + Cskip)
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[i](x, context)
        if self.upsamplers is not None:
            # To the next skip's size: x2, or diffusers' upsample_size when a latent side is odd.
            x = self.upsamplers[0](x, skips[-1].shape[1:3])
        return x


class MidBlock(nnx.Module):
    """UNetMidBlock2DCrossAttn: resnet, (transformer, resnet)."""

    def __init__(self, channels: int, heads: int, t_layers: int, scale: float, s: _Spec, *, rngs: nnx.Rngs):
        self.resnets = nnx.List([s.resnet(channels, channels, scale, rngs) for _ in range(2)])
        self.attentions = nnx.List([s.transformer(channels, heads, t_layers, rngs)])

    def __call__(self, x: Array, temb: Array, context: Array) -> Array:
        x = self.resnets[0](x, temb)
        x = self.attentions[0](x, context)
        return self.resnets[1](x, temb)


# ----------------------------------------------------------------------------------------------


def check_unet_inputs(c: UNet2DConditionConfig, x: Array, t: Array, context: Array,
                      added: Mapping[str, Array] | None) -> None:
    """Shapes are static under jit: a wrong one is a one-line error at trace time."""
    if x.ndim != 4 or x.shape[-1] != c.in_channels:
        raise InvalidArgumentError(f"sample must be (B, H, W, {c.in_channels}) NHWC, got shape {tuple(x.shape)}")
    b = x.shape[0]
    if jnp.ndim(t) not in (0, 1) or (jnp.ndim(t) == 1 and jnp.shape(t)[0] not in (1, b)):
        raise InvalidArgumentError(f"timestep must be a scalar or ({b},), got shape {tuple(jnp.shape(t))}")
    if context.ndim != 3 or context.shape[0] != b or context.shape[-1] != c.cross_attention_dim:
        raise InvalidArgumentError(
            f"encoder_hidden_states must be ({b}, L, {c.cross_attention_dim}), got shape {tuple(context.shape)}")
    if c.addition_embed_type != "text_time":
        return
    missing = [k for k in ("text_embeds", "time_ids") if not added or k not in added]
    if missing:
        raise InvalidArgumentError(
            f"this UNet (addition_embed_type 'text_time') needs added_cond {', '.join(missing)}")
    text, ids = added["text_embeds"], added["time_ids"]
    if text.ndim != 2 or ids.ndim != 2 or text.shape[0] != b or ids.shape[0] != b:
        raise InvalidArgumentError(
            f"text_embeds and time_ids must be ({b}, P) and ({b}, N), got {tuple(text.shape)} and {tuple(ids.shape)}")
    width = text.shape[1] + ids.shape[1] * c.addition_time_embed_dim
    if width != c.projection_class_embeddings_input_dim:
        raise InvalidArgumentError(
            f"text_embeds width {text.shape[1]} + {ids.shape[1]} time_ids x {c.addition_time_embed_dim} = {width}, "
            f"but projection_class_embeddings_input_dim is {c.projection_class_embeddings_input_dim}")


class Residuals(NamedTuple):
    """What a ControlNet adds to the UNet (diffusers' ``down_block_additional_residuals`` and
    ``mid_block_additional_residual``): one tensor per skip the down half keeps, NHWC."""

    down: tuple[Array, ...]  # each (B, h_i, w_i, C_i), in the order the skips are made (conv_in's first)
    mid: Array  # (B, h, w, C_last): added to the mid block's output


class DownHalf(nnx.Module):
    """What diffusers' UNet2DConditionModel and ControlNetModel share, under the same names:
    ``conv_in``, the time embedding (and SDXL's "text_time" ``add_embedding``), the down blocks
    and the mid block. Both subclasses build it with :meth:`build_down_half` and run it with
    :meth:`embed` and :meth:`down_half`."""

    def build_down_half(self, c: UNet2DConditionConfig, rngs: nnx.Rngs, stacked: bool = False) -> _Spec:
        ch0 = c.block_out_channels[0]
        tdim = c.time_embed_dim
        self.conv_in = Conv2d(c.in_channels, ch0, 3, padding=1, rngs=rngs)
        self.time_embedding = TimestepEmbedding(ch0, tdim, rngs=rngs)  # time_proj: sinusoidal, no weights
        if c.addition_embed_type == "text_time":  # add_time_proj: sinusoidal, no weights
            self.add_embedding = TimestepEmbedding(c.projection_class_embeddings_input_dim, tdim, rngs=rngs)
        else:
            self.add_embedding = None

        spec = _Spec(c.norm_num_groups, c.norm_eps, c.act_fn, tdim, c.cross_attention_dim, c.use_linear_projection,
                     c.upcast, stacked)
        chans, heads, layers, t_layers = c.block_out_channels, c.heads, c.layers, c.transformer_layers
        n = len(chans)
        down = []
        out_ch = chans[0]
        for i, kind in enumerate(c.down_block_types):
            in_ch, out_ch = out_ch, chans[i]
            down.append(DownBlock(in_ch, out_ch, layers[i], kind == "CrossAttnDownBlock2D", heads[i], t_layers[i],
                                  i < n - 1, c.downsample_padding, spec, rngs=rngs))
        self.down_blocks = nnx.List(down)

        if c.mid_block_type is not None:
            self.mid_block = MidBlock(chans[-1], heads[-1], t_layers[-1], c.mid_block_scale_factor, spec, rngs=rngs)
        else:
            self.mid_block = None
        return spec

    def embed(self, c: UNet2DConditionConfig, t: Array, added: Mapping[str, Array] | None, b: int,
              dtype: Any) -> Array:
        """(B,) timesteps (+ SDXL's text_embeds (B, P) and time_ids (B, N)) -> the embedding (B, T)."""
        t = jnp.broadcast_to(jnp.asarray(t).reshape(-1), (b,))
        t_feat = sinusoidal_embedding(t, c.block_out_channels[0], c.flip_sin_to_cos, c.freq_shift)
        emb = self.time_embedding(t_feat.astype(dtype))  # (B, T)
        if self.add_embedding is not None:
            ids = added["time_ids"]  # (B, N): SDXL's original size, crop top-left, target size
            id_feat = sinusoidal_embedding(ids.reshape(-1), c.addition_time_embed_dim, c.flip_sin_to_cos, c.freq_shift)
            id_feat = id_feat.reshape(b, -1)  # (B, N * addition_time_embed_dim)
            add = jnp.concatenate([added["text_embeds"].astype(jnp.float32), id_feat], axis=-1).astype(dtype)
            emb = emb + self.add_embedding(add)
        return emb

    def down_half(self, h: Array, emb: Array, context: Array) -> tuple[Array, list[Array]]:
        """conv_in's output (B, H, W, C0) -> (the mid block's output, every skip the down blocks keep)."""
        skips = [h]
        for block in self.down_blocks:
            h, res = block(h, emb, context)
            skips.extend(res)
        if self.mid_block is not None:
            h = self.mid_block(h, emb, context)
        return h, skips


class UNet2DConditionModule(DownHalf):
    """diffusers' ``UNet2DConditionModel`` as a Flax NNX module (the network; ``__call__`` is NHWC);
    ``LoadedUNet2DCondition`` is the loaded, NCHW-facing wrapper."""

    def __init__(self, config: UNet2DConditionConfig, *, rngs: nnx.Rngs, stacked: bool = False):
        c = config
        c.validate()
        self.config = c
        spec = self.build_down_half(c, rngs, stacked)
        chans, heads, layers, t_layers = c.block_out_channels, c.heads, c.layers, c.transformer_layers
        n = len(chans)
        rev, rev_heads, rev_layers, rev_t = (list(reversed(v)) for v in (chans, heads, layers, t_layers))
        up = []
        out_ch = rev[0]
        for i, kind in enumerate(c.up_block_types):
            prev, out_ch = out_ch, rev[i]
            in_ch = rev[min(i + 1, n - 1)]
            up.append(UpBlock(in_ch, prev, out_ch, rev_layers[i] + 1, kind == "CrossAttnUpBlock2D", rev_heads[i],
                              rev_t[i], i < n - 1, spec, rngs=rngs))
        self.up_blocks = nnx.List(up)

        ch0 = chans[0]
        self.conv_norm_out = GroupNorm(c.norm_num_groups, ch0, c.norm_eps)
        self.conv_out = Conv2d(ch0, c.out_channels, 3, padding=1, rngs=rngs)

    def __call__(self, x: Array, t: Array, context: Array, added: Mapping[str, Array] | None = None,
                 residuals: Residuals | None = None) -> Array:
        """(B, H, W, Cin), (B,) timesteps, (B, L, D) text states, SDXL's added ids -> (B, H, W, Cout).

        ``residuals``: a ControlNet's (``preheat.models.controlnet``), added to the skips and the
        mid block's output as diffusers' ``down_block_additional_residuals`` / ``mid_block_additional_residual``."""
        check_unet_inputs(self.config, x, t, context, added)
        c = self.config
        dtype = x.dtype
        if c.center_input_sample:
            x = 2 * x - 1.0
        emb = self.embed(c, t, added, x.shape[0], dtype)
        context = context.astype(dtype)
        act = activation(c.act_fn)

        h, skips = self.down_half(self.conv_in(x), emb, context)
        if residuals is not None:
            if len(residuals.down) != len(skips):
                raise InvalidArgumentError(f"a ControlNet gives {len(residuals.down)} down residuals but this UNet "
                                           f"keeps {len(skips)} skips; they do not belong together")
            skips = [s + r.astype(s.dtype) for s, r in zip(skips, residuals.down)]  # each (B, h_i, w_i, C_i)
            h = h + residuals.mid.astype(h.dtype)
        for block in self.up_blocks:
            h = block(h, skips, emb, context)
        return self.conv_out(act(self.conv_norm_out(h)))


# ----------------------------------------------------------------------------------------------
# Loading


def read_unet_condition_config(unet_dir: Path) -> UNet2DConditionConfig:
    return UNet2DConditionConfig.from_dict(read_json(unet_dir / "config.json"), str(unet_dir / "config.json"))


def build_abstract(config: UNet2DConditionConfig, stacked: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and a State of ShapeDtypeStructs; costs no FLOPs and no memory.
    ``stacked``: the serving form, deep transformer stages scanned (``preheat.models.stacking``);
    the default is the checkpoint's form, one leaf per checkpoint tensor."""
    return weights.build_abstract(lambda rngs: UNet2DConditionModule(config, rngs=rngs, stacked=stacked))


def check_text_conditioning(config: UNet2DConditionConfig, context_width: int, pooled_width: int | None = None,
                            n_ids: int = 6, source: str = "the UNet") -> None:
    """Refuse a text encoder whose hidden width (and, for SDXL, pooled width) this UNet cannot take.

    ``context_width``: the width of ``encoder_hidden_states`` the pipeline will pass (SDXL: both
    encoders' widths summed). ``pooled_width``: the pooled text embedding's width ("text_time" only);
    ``n_ids``: the time ids beside it (SDXL's 6; a refiner's 5: the aesthetic score for the target size).
    """
    if context_width != config.cross_attention_dim:
        raise ModelFormatError(
            f"{source} has cross_attention_dim {config.cross_attention_dim} but the text encoder gives "
            f"{context_width}-wide hidden states; the UNet and text encoder do not belong together")
    if config.addition_embed_type == "text_time" and pooled_width is not None:
        got = (config.projection_class_embeddings_input_dim - pooled_width) / config.addition_time_embed_dim
        if got != n_ids:
            raise ModelFormatError(
                f"{source} has projection_class_embeddings_input_dim {config.projection_class_embeddings_input_dim}, "
                f"which is not the pooled text width {pooled_width} + {n_ids} x addition_time_embed_dim "
                f"{config.addition_time_embed_dim}")


@dataclass
class LoadedUNet2DCondition:
    """A loaded text-conditioned UNet.

    ``apply`` is the pure NHWC function a sampler compiles, the weights an argument so that one
    compiled program serves every fine-tune; ``__call__`` mirrors diffusers' NCHW ``.sample``.
    """

    config: UNet2DConditionConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: Any = jnp.float32

    def apply(self, params: nnx.State, x: Array, t: Array, context: Array,
              added: Mapping[str, Array] | None = None, lora: Any = None, residuals: Residuals | None = None) -> Array:
        """(B, H, W, C), (B,), (B, L, D), {"text_embeds": (B, P), "time_ids": (B, 6)} -> (B, H, W, C).

        ``lora``: per-image low-rank adapters (``preheat.models.adapters.Adapters``), or None;
        ``residuals``: a ControlNet's, or None."""
        from preheat.models.adapters import attach

        model = attach(nnx.merge(self.graphdef, upcast(params, self.dtype, tie=x)), lora)  # fp8-stored weights upcast here
        return model(x, t, context, added, residuals)

    def check_text_conditioning(self, context_width: int, pooled_width: int | None = None, n_ids: int = 6) -> None:
        check_text_conditioning(self.config, context_width, pooled_width, n_ids)

    def __call__(self, sample: Any, timestep: Any, encoder_hidden_states: Any,
                 added_cond_kwargs: Mapping[str, Any] | None = None,
                 down_block_additional_residuals: Sequence[Any] | None = None,
                 mid_block_additional_residual: Any = None) -> Array:
        x = jnp.asarray(sample, self.dtype)
        if x.ndim != 4:
            raise InvalidArgumentError(f"sample must be (B, C, H, W), got shape {tuple(x.shape)}")
        x = jnp.transpose(x, (0, 2, 3, 1))  # NCHW -> NHWC
        t = jnp.asarray(timestep, jnp.float32)
        context = jnp.asarray(encoder_hidden_states, self.dtype)
        added = None if added_cond_kwargs is None else {k: jnp.asarray(v) for k, v in added_cond_kwargs.items()}
        residuals = None
        if down_block_additional_residuals is not None:  # NCHW, as diffusers takes them -> NHWC
            residuals = Residuals(down=tuple(jnp.transpose(jnp.asarray(r), (0, 2, 3, 1))
                                             for r in down_block_additional_residuals),
                                  mid=jnp.transpose(jnp.asarray(mid_block_additional_residual), (0, 2, 3, 1)))
        out = self.apply(self.params, x, t, context, added, residuals=residuals)
        return jnp.transpose(out, (0, 3, 1, 2))  # NHWC -> NCHW


def build_unet_condition(config: UNet2DConditionConfig, tensors: Mapping[str, Any], dtype: Any = jnp.float32,
                         source: str = "UNet2DConditionModel weights",
                         options: LoadOptions | None = None) -> LoadedUNet2DCondition:
    """A loaded UNet from torch-layout tensors keyed like diffusers' state dict (numpy arrays)."""
    dtype = check_dtype(dtype)
    graphdef, abstract = build_abstract(config)
    params = fill(abstract, tensors, dtype, source, options=options, low=layerwise(("norm",), options))  # a Checkpoint streams
    if any(scanned(n) for n in config.transformer_layers):  # deep stages scanned: weights stacked once, here
        graphdef, params = stack(lambda rngs: UNet2DConditionModule(config, rngs=rngs, stacked=True), params, options)
    return LoadedUNet2DCondition(config=config, graphdef=graphdef, params=params, dtype=dtype)


def load_unet_condition(folder: str | Path, dtype: Any = jnp.float32, variant: str | None = None,
                        options: LoadOptions | None = None) -> LoadedUNet2DCondition:
    """Load a diffusers UNet2DConditionModel folder (or a pipeline folder's ``unet/``) into JAX.

    ``variant="fp16"`` reads ``diffusion_pytorch_model.fp16.safetensors`` (or its shard index);
    the weights are cast to ``dtype`` whatever dtype they were stored in. (diffusers' deprecated
    attention names, ``query``/``key``/``value``/``proj_attn``, belong only to blocks this model
    does not have, so no key is renamed.)
    """
    dtype = check_dtype(dtype)
    unet_dir = resolve_unet_dir(folder)
    config = read_unet_condition_config(unet_dir)
    tensors = read_tensors(weight_files(unet_dir, (DIFFUSERS_STEM,), variant=variant))
    return build_unet_condition(config, tensors, dtype, str(unet_dir), options)
