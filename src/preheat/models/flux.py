"""Diffusers' ``FluxTransformer2DModel`` (FLUX.1 schnell and dev) in JAX (Flax NNX).

The Flux transformer works on *tokens*: the VAE's 16-channel latent is packed 2x2 into
(h/2 * w/2) tokens of 64 channels (``pack_latents``), the T5 prompt states are the text tokens,
and the CLIP pooled embedding, the timestep and (dev) the guidance scale form one conditioning
vector ``temb``. ``num_layers`` double-stream blocks keep text and image weights apart and attend
jointly; ``num_single_layers`` single-stream blocks run on the concatenated [text, image] sequence.
Positions enter only through 3-axis rotary embeddings computed from the ids (``img_ids``,
``txt_ids``), which are data: changing the resolution changes shapes, never weights.

As in ``unet2d``: every submodule is named exactly like diffusers' so a parameter path *is* its
checkpoint key (``transformer_blocks.3.attn.add_q_proj.weight``), built abstractly and filled
from safetensors, weights passed as an argument (``FluxTransformer.apply``). Attention goes
through ``jax.nn.dot_product_attention`` so that GPUs with cuDNN get fused attention.

What is static (the compiled program) and what is data::

    static: the config (architecture_dict), dtype, batch, image tokens S, text tokens T
    data:   params, hidden_states, encoder_hidden_states, pooled_projections, timestep (sigma),
            img_ids, txt_ids, guidance

Conventions, as diffusers' ``FluxPipeline`` calls the model: ``timestep`` is the flow-matching
sigma in [0, 1] (the pipeline passes ``t / 1000``; the model multiplies by 1000 again),
``guidance`` is the raw guidance scale (e.g. 3.5; dev only), ``txt_ids`` are zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preheat.errors import InvalidArgumentError, UnsupportedConfigError
from preheat.models import weights
from preheat.models.dit import AdaLayerNormContinuous, FeedForward, layer_norm, modulate, resolve_transformer_dir
from preheat.models.config import JsonConfig
from preheat.models.layers import Linear, TimestepEmbedding, lift, sinusoidal_embedding
from preheat.models.stacking import blocks, run_blocks, scanned, stack
from preheat.models.storage import layerwise, upcast
from preheat.models.safetensors_files import DIFFUSERS_STEM, read_json, read_tensors, weight_files
from preheat.models.weights import LoadOptions, check_dtype, fill
from preheat.models.attention import dot_product_attention

__all__ = [
    "SUPPORTED",
    "ROPE_THETA",
    "FluxTransformerConfig",
    "FluxTransformer2DModel",
    "FluxTransformer",
    "read_flux_config",
    "build_abstract",
    "build_flux_transformer",
    "load_flux_transformer",
    "rope_cos_sin",
    "apply_rope",
    "pack_latents",
    "unpack_latents",
    "latent_image_ids",
]

Array = jax.Array

# Everything the published FLUX.1 transformers use. Any other value is refused by name.
SUPPORTED: dict[str, tuple[Any, ...]] = {
    "_class_name": ("FluxTransformer2DModel",),
    "patch_size": (1,),  # diffusers' packing is always 2x2 outside the model; patch_size only widens proj_out
}

ROPE_THETA = 10000.0  # FluxPosEmbed(theta=10000), fixed in diffusers
_TIME_CHANNELS = 256  # Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0)
_NORM_EPS = 1e-6  # every LayerNorm / RMSNorm of the model


@dataclass(frozen=True)
class FluxTransformerConfig(JsonConfig):
    """The architecture, from diffusers' ``transformer/config.json`` (same names, same defaults)."""

    patch_size: int = 1
    in_channels: int = 64  # packed latent channels: 4 x the VAE's 16 (Fill / Depth variants: more)
    out_channels: int | None = None  # None: in_channels
    num_layers: int = 19  # double-stream blocks (text and image weights apart)
    num_single_layers: int = 38  # single-stream blocks (one sequence, parallel attention + MLP)
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096  # width of the T5 prompt states
    pooled_projection_dim: int = 768  # width of CLIP's pooled text embedding
    guidance_embeds: bool = False  # dev: the guidance scale is an input embedding (no CFG pass)
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)  # rotary widths per id axis; they sum to attention_head_dim

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "FluxTransformerConfig":
        return cls.from_checked_dict(raw, source, "FluxTransformer2DModel")

    def validate(self, source: str = "config") -> None:
        for name, allowed in SUPPORTED.items():
            if not name.startswith("_") and getattr(self, name) not in allowed:
                raise UnsupportedConfigError(
                    f"unsupported FluxTransformer2DModel {name} {getattr(self, name)!r} in {source}; supported: "
                    + ", ".join(repr(v) for v in allowed))
        for name in ("in_channels", "num_attention_heads", "attention_head_dim", "joint_attention_dim",
                     "pooled_projection_dim", "num_layers", "num_single_layers", "out_channels"):
            value = getattr(self, name)
            if name == "out_channels" and value is None:
                continue
            positive = 1 if name not in ("num_layers", "num_single_layers") else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < positive:
                raise UnsupportedConfigError(
                    f"{source}: {name} must be an integer >= {positive}, got {value!r}")
        if not isinstance(self.guidance_embeds, bool):
            raise UnsupportedConfigError(
                f"{source}: guidance_embeds must be true or false, got {self.guidance_embeds!r}")
        axes = self.axes_dims_rope
        if (not isinstance(axes, tuple) or not axes
                or any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 or d % 2 for d in axes)):
            raise UnsupportedConfigError(f"{source}: axes_dims_rope must be positive even integers, got {axes!r}")
        if sum(axes) != self.attention_head_dim:
            raise UnsupportedConfigError(
                f"{source}: axes_dims_rope {list(axes)} sums to {sum(axes)}, but attention_head_dim is "
                f"{self.attention_head_dim}; rotary embeddings must span each head")

    def architecture_dict(self) -> dict[str, Any]:
        """The fields that change the program (for cache keys): all of them."""
        return self.to_dict()

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def output_channels(self) -> int:
        """Channels per output token (diffusers' ``out_channels or in_channels``, times patch_size^2)."""
        return self.patch_size * self.patch_size * (self.out_channels or self.in_channels)


def thousandfold(v: Array, dtype: Any) -> Array:
    """diffusers' ``v.to(dtype) * 1000`` (the timestep's and the guidance scale's) with both of its
    roundings to ``dtype``, as float32. (B,) -> (B,).

    XLA may keep excess precision between a half-type product and a later float32 convert, and
    XLA:CPU does: there 3.5 x 1000 stayed 3500 while torch and XLA:TPU give bfloat16's 3504, whose
    sinusoids differ enough to move the prediction 27% at one block (docs/tpu.md). ``reduce_precision``
    is never elided, so every backend embeds what diffusers embeds."""
    v = v.astype(jnp.float32)
    if jnp.dtype(dtype).itemsize >= 4:
        return v * 1000
    info = jnp.finfo(dtype)

    def rounded(x: Array) -> Array:
        return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)

    return rounded(rounded(v) * 1000)  # bf16: 3.5 -> 3504


# ----------------------------------------------------------------------------------------------
# Rotary position embeddings (FluxPosEmbed + apply_rotary_emb(use_real=True, unbind_dim=-1))


def _rope_frequencies(axes_dims: tuple[int, ...], theta: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rotary pair: its id axis, and its frequency split hi + lo in float32.

    diffusers computes the angles ``pos * freq`` in float64. JAX runs in float32, where the
    product's rounding costs ~4e-6 of angle at position 64. ``hi`` keeps 12 significant bits, so
    ``pos * hi`` is exact for integer positions below 4096, and the small ``pos * lo`` is added by
    the angle-sum formula: float64-faithful angles without enabling x64.
    """
    freqs = np.concatenate([1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d) for d in axes_dims])  # (D/2,)
    mant, exp = np.frexp(freqs)
    hi = np.ldexp(np.round(mant * 4096.0) / 4096.0, exp)
    lo = freqs - hi
    axis = np.concatenate([np.full(d // 2, i, dtype=np.int32) for i, d in enumerate(axes_dims)])
    return axis, hi.astype(np.float32), lo.astype(np.float32)


def rope_cos_sin(ids: Array, axes_dims: tuple[int, ...], theta: float = ROPE_THETA) -> tuple[Array, Array]:
    """FluxPosEmbed: (N, n_axes) ids -> cos, sin, each (N, sum(axes_dims)) float32, pairs repeated."""
    axis, hi, lo = _rope_frequencies(tuple(axes_dims), theta)
    pos = jnp.take(ids.astype(jnp.float32), jnp.asarray(axis), axis=1)  # (N, D/2): each pair's position
    a_hi = pos * jnp.asarray(hi)[None, :]
    a_lo = pos * jnp.asarray(lo)[None, :]
    cos = jnp.cos(a_hi) * jnp.cos(a_lo) - jnp.sin(a_hi) * jnp.sin(a_lo)  # cos(a_hi + a_lo)
    sin = jnp.sin(a_hi) * jnp.cos(a_lo) + jnp.cos(a_hi) * jnp.sin(a_lo)
    return jnp.repeat(cos, 2, axis=-1), jnp.repeat(sin, 2, axis=-1)  # (N, D): repeat_interleave(2)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate each (even, odd) channel pair of (B, N, nH, D) by its angle; float32 inside, x's dtype out."""
    b, n, h, d = x.shape
    pairs = x.astype(jnp.float32).reshape(b, n, h, d // 2, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(b, n, h, d)  # (-x_odd, x_even)
    out = x.astype(jnp.float32) * cos[None, :, None, :] + rotated * sin[None, :, None, :]
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# Layers


def _clip_fp16(x: Array) -> Array:
    """diffusers clips float16 residual streams to the finite range (Flux overflows otherwise)."""
    return jnp.clip(x, -65504, 65504) if x.dtype == jnp.float16 else x


class RMSNorm(nnx.Module):
    """``torch.nn.RMSNorm`` with a weight, over the last axis; float32 statistics."""

    def __init__(self, dim: int, eps: float):
        self.scale = weights.param((dim,), lambda: jnp.ones((dim,)))
        self.eps = eps

    def __call__(self, x: Array) -> Array:  # (..., D) -> (..., D)
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.square(h).mean(axis=-1, keepdims=True) + self.eps)
        return (h * lift(self.scale[...].astype(jnp.float32), h.ndim)).astype(x.dtype)


class AdaLayerNormZero(nnx.Module):
    """Six modulations from temb; returns the modulated input and the other five."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = Linear(dim, 6 * dim, rngs=rngs)

    def __call__(self, x: Array, temb: Array) -> tuple[Array, ...]:  # (B, L, C), (B, C)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = jnp.split(
            self.linear(jax.nn.silu(temb)), 6, axis=-1)  # each (B, C)
        return modulate(layer_norm(x), shift_msa, scale_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = Linear(dim, 3 * dim, rngs=rngs)

    def __call__(self, x: Array, temb: Array) -> tuple[Array, Array]:  # (B, L, C), (B, C)
        shift, scale, gate = jnp.split(self.linear(jax.nn.silu(temb)), 3, axis=-1)
        return modulate(layer_norm(x), shift, scale), gate


class FluxAttention(nnx.Module):
    """Multi-head attention with RMS-normalised q/k and rotary positions.

    ``joint`` (double-stream blocks): the text has its own projections (``add_*_proj``,
    ``norm_added_*``, ``to_add_out``); text and image tokens attend together as [text, image].
    Otherwise (single-stream blocks) there is no output projection: the block's ``proj_out`` does it.
    """

    def __init__(self, dim: int, heads: int, head_dim: int, *, joint: bool, rngs: nnx.Rngs):
        inner = heads * head_dim
        self.heads = heads
        self.head_dim = head_dim
        self.norm_q = RMSNorm(head_dim, _NORM_EPS)
        self.norm_k = RMSNorm(head_dim, _NORM_EPS)
        self.to_q = Linear(dim, inner, rngs=rngs)
        self.to_k = Linear(dim, inner, rngs=rngs)
        self.to_v = Linear(dim, inner, rngs=rngs)
        if joint:
            self.to_out = nnx.List([Linear(inner, dim, rngs=rngs)])  # to_out.1 is dropout in torch
            self.norm_added_q = RMSNorm(head_dim, _NORM_EPS)
            self.norm_added_k = RMSNorm(head_dim, _NORM_EPS)
            self.add_q_proj = Linear(dim, inner, rngs=rngs)
            self.add_k_proj = Linear(dim, inner, rngs=rngs)
            self.add_v_proj = Linear(dim, inner, rngs=rngs)
            self.to_add_out = Linear(inner, dim, rngs=rngs)
        else:
            self.to_out = None
        self.joint = joint

    def _heads(self, y: Array) -> Array:  # (B, L, nH*Dh) -> (B, L, nH, Dh)
        return y.reshape(y.shape[0], y.shape[1], self.heads, self.head_dim)

    def __call__(self, x: Array, context: Array | None, cos: Array, sin: Array) -> Any:
        """Joint: (B, S, C) image, (B, T, C) text -> (image, text) outputs. Single: (B, L, C) -> (B, L, nH*Dh).

        ``cos``/``sin``: (T + S, Dh) or (L, Dh), in the token order [text, image].
        """
        q = self.norm_q(self._heads(self.to_q(x)))  # (B, S, nH, Dh)
        k = self.norm_k(self._heads(self.to_k(x)))
        v = self._heads(self.to_v(x))
        if self.joint:
            q = jnp.concatenate([self.norm_added_q(self._heads(self.add_q_proj(context))), q], axis=1)  # (B, T+S, ..)
            k = jnp.concatenate([self.norm_added_k(self._heads(self.add_k_proj(context))), k], axis=1)
            v = jnp.concatenate([self._heads(self.add_v_proj(context)), v], axis=1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = dot_product_attention(q, k, v)  # (B, L, nH, Dh); scale 1/sqrt(Dh)
        out = out.astype(x.dtype).reshape(out.shape[0], out.shape[1], self.heads * self.head_dim)
        if not self.joint:
            return out
        t = context.shape[1]
        return self.to_out[0](out[:, t:]), self.to_add_out(out[:, :t])


class FluxTransformerBlock(nnx.Module):
    """Double-stream (MMDiT) block: separate adaLN, projections and MLPs for image and text."""

    def __init__(self, dim: int, heads: int, head_dim: int, *, rngs: nnx.Rngs):
        self.norm1 = AdaLayerNormZero(dim, rngs=rngs)
        self.norm1_context = AdaLayerNormZero(dim, rngs=rngs)
        self.attn = FluxAttention(dim, heads, head_dim, joint=True, rngs=rngs)
        self.ff = FeedForward(dim, rngs=rngs)  # norm2 / norm2_context: LayerNorms without weights
        self.ff_context = FeedForward(dim, rngs=rngs)

    def __call__(self, x: Array, context: Array, temb: Array, cos: Array, sin: Array) -> tuple[Array, Array]:
        """(B, S, C) image, (B, T, C) text, (B, C) -> (text, image)."""
        h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, temb)
        c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(context, temb)
        attn, context_attn = self.attn(h, c, cos, sin)

        x = x + gate_msa[:, None, :] * attn
        x = x + gate_mlp[:, None, :] * self.ff(modulate(layer_norm(x), shift_mlp, scale_mlp))

        context = context + c_gate_msa[:, None, :] * context_attn
        context = context + c_gate_mlp[:, None, :] * self.ff_context(modulate(layer_norm(context), c_shift_mlp,
                                                                               c_scale_mlp))
        return _clip_fp16(context), x


class FluxSingleTransformerBlock(nnx.Module):
    """Single-stream block on [text, image]: attention and a tanh-GELU MLP in parallel, one proj_out."""

    def __init__(self, dim: int, heads: int, head_dim: int, *, mlp_ratio: float = 4.0, rngs: nnx.Rngs):
        mlp = int(dim * mlp_ratio)
        self.norm = AdaLayerNormZeroSingle(dim, rngs=rngs)
        self.proj_mlp = Linear(dim, mlp, rngs=rngs)
        self.proj_out = Linear(dim + mlp, dim, rngs=rngs)
        self.attn = FluxAttention(dim, heads, head_dim, joint=False, rngs=rngs)

    def __call__(self, x: Array, temb: Array, cos: Array, sin: Array) -> Array:  # (B, T+S, C) -> (B, T+S, C)
        h, gate = self.norm(x, temb)
        mlp = jax.nn.gelu(self.proj_mlp(h), approximate=True)  # (B, L, 4C)
        attn = self.attn(h, None, cos, sin)  # (B, L, C)
        out = self.proj_out(jnp.concatenate([attn, mlp], axis=-1))
        return _clip_fp16(x + gate[:, None, :] * out)


class CombinedTimestepTextProjEmbeddings(nnx.Module):
    """temb = MLP(sin(t)) [+ MLP(sin(guidance)), dev] + MLP(pooled CLIP text).

    ``text_embedder`` is diffusers' ``PixArtAlphaTextProjection(act_fn="silu")``: the same
    linear_1 / SiLU / linear_2 as ``TimestepEmbedding``, so that class is reused.
    """

    def __init__(self, dim: int, pooled_dim: int, guidance: bool, *, rngs: nnx.Rngs):
        self.timestep_embedder = TimestepEmbedding(_TIME_CHANNELS, dim, rngs=rngs)
        self.guidance_embedder = TimestepEmbedding(_TIME_CHANNELS, dim, rngs=rngs) if guidance else None
        self.text_embedder = TimestepEmbedding(pooled_dim, dim, rngs=rngs)

    def __call__(self, t: Array, guidance: Array | None, pooled: Array) -> Array:  # (B,), (B,), (B, P) -> (B, C)
        dtype = pooled.dtype
        emb = self.timestep_embedder(sinusoidal_embedding(t, _TIME_CHANNELS, True, 0).astype(dtype))
        if self.guidance_embedder is not None:
            emb = emb + self.guidance_embedder(sinusoidal_embedding(guidance, _TIME_CHANNELS, True, 0).astype(dtype))
        return emb + self.text_embedder(pooled)


# ----------------------------------------------------------------------------------------------


class FluxTransformer2DModel(nnx.Module):
    """The network on packed tokens; ``FluxTransformer`` is the loaded wrapper with ``apply``."""

    def __init__(self, config: FluxTransformerConfig, *, rngs: nnx.Rngs, stacked: bool = False):
        """``stacked``: the serving form, each run of 3+ blocks one scanned ``stacking.BlockStack``."""
        c = config
        c.validate()
        self.config = c
        dim, heads, head_dim = c.inner_dim, c.num_attention_heads, c.attention_head_dim
        # pos_embed (FluxPosEmbed) has no weights: see rope_cos_sin
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(dim, c.pooled_projection_dim, c.guidance_embeds,
                                                                  rngs=rngs)
        self.context_embedder = Linear(c.joint_attention_dim, dim, rngs=rngs)
        self.x_embedder = Linear(c.in_channels, dim, rngs=rngs)
        self.transformer_blocks = blocks(lambda: FluxTransformerBlock(dim, heads, head_dim, rngs=rngs), c.num_layers,
                                         stacked)
        self.single_transformer_blocks = blocks(lambda: FluxSingleTransformerBlock(dim, heads, head_dim, rngs=rngs),
                                                c.num_single_layers, stacked)
        self.norm_out = AdaLayerNormContinuous(dim, dim, rngs=rngs)
        self.proj_out = Linear(dim, c.output_channels, rngs=rngs)

    def check_inputs(self, x: Array, context: Array, pooled: Array, t: Array, img_ids: Array, txt_ids: Array,
                     guidance: Array | None) -> None:
        """Shapes are static under jit: a wrong one is a one-line error at trace time."""
        c = self.config
        if x.ndim != 3 or x.shape[-1] != c.in_channels:
            raise InvalidArgumentError(
                f"hidden_states must be (B, S, {c.in_channels}) packed latent tokens, got shape {tuple(x.shape)}",
                argument="hidden_states")
        b, s = x.shape[:2]
        if context.ndim != 3 or context.shape[0] != b or context.shape[-1] != c.joint_attention_dim:
            raise InvalidArgumentError(
                f"encoder_hidden_states must be ({b}, T, {c.joint_attention_dim}), got shape {tuple(context.shape)}",
                argument="encoder_hidden_states")
        if pooled.shape != (b, c.pooled_projection_dim):
            raise InvalidArgumentError(
                f"pooled_projections must be ({b}, {c.pooled_projection_dim}), got shape {tuple(pooled.shape)}",
                argument="pooled_projections")
        n_axes = len(c.axes_dims_rope)
        for name, ids, n in (("img_ids", img_ids, s), ("txt_ids", txt_ids, context.shape[1])):
            if ids.shape != (n, n_axes):
                raise InvalidArgumentError(f"{name} must be ({n}, {n_axes}), got shape {tuple(ids.shape)}",
                                           argument=name)
        for name, v in (("timestep", t), ("guidance", guidance)):
            if v is not None and v.shape not in ((), (b,)):
                raise InvalidArgumentError(f"{name} must be a scalar or ({b},), got shape {tuple(v.shape)}",
                                           argument=name)
        if c.guidance_embeds and guidance is None:
            raise InvalidArgumentError(
                "this Flux transformer has guidance_embeds (FLUX.1-dev style): pass guidance (the guidance scale)",
                argument="guidance")
        if not c.guidance_embeds and guidance is not None:
            raise InvalidArgumentError(
                "this Flux transformer has no guidance_embeds (FLUX.1-schnell style): pass guidance=None",
                argument="guidance")

    def __call__(self, x: Array, context: Array, pooled: Array, t: Array, img_ids: Array, txt_ids: Array,
                 guidance: Array | None = None) -> Array:
        """(B, S, Cin) tokens, (B, T, Dtxt), (B, P), (B,) sigma, (S, 3), (T, 3), (B,) | None -> (B, S, Cout)."""
        self.check_inputs(x, context, pooled, t, img_ids, txt_ids, guidance)
        dtype = x.dtype
        b, s = x.shape[:2]
        tokens = context.shape[1]
        t = jnp.broadcast_to(thousandfold(t, dtype), (b,))  # then float32 sinusoids
        g = None if guidance is None else jnp.broadcast_to(thousandfold(guidance, dtype), (b,))
        temb = self.time_text_embed(t, g, pooled)  # (B, C)

        h = self.x_embedder(x)  # (B, S, C)
        ctx = self.context_embedder(context)  # (B, T, C)
        ids = jnp.concatenate([txt_ids, img_ids], axis=0)  # (T + S, 3): the token order of joint attention
        cos, sin = rope_cos_sin(ids, self.config.axes_dims_rope)
        ctx, h = run_blocks(self.transformer_blocks, (ctx, h),
                            lambda block, carry: block(carry[1], carry[0], temb, cos, sin))  # (text, image)
        joint = jnp.concatenate([ctx, h], axis=1)  # (B, T + S, C)
        joint = run_blocks(self.single_transformer_blocks, joint, lambda block, j: block(j, temb, cos, sin))
        h = joint[:, tokens:]  # (B, S, C)
        return self.proj_out(self.norm_out(h, temb))  # (B, S, Cout)


# ----------------------------------------------------------------------------------------------
# Latent packing (diffusers' FluxPipeline._pack_latents / _unpack_latents / _prepare_latent_image_ids,
# for NHWC latents)


def _check_even(h: int, w: int, what: str) -> None:
    if h % 2 or w % 2:
        raise InvalidArgumentError(f"{what}: latent height and width must be even (2x2 packing), got {h}x{w}")


def pack_latents(x: Array) -> Array:
    """(B, h, w, C) NHWC latents -> (B, h/2 * w/2, 4C) tokens, each token's channels in (C, 2, 2) order."""
    b, h, w, c = x.shape
    _check_even(h, w, "pack_latents")
    x = x.reshape(b, h // 2, 2, w // 2, 2, c)  # (B, i, di, j, dj, C)
    return x.transpose(0, 1, 3, 5, 2, 4).reshape(b, (h // 2) * (w // 2), c * 4)  # (B, i*j, C*di*dj)


def unpack_latents(tokens: Array, h: int, w: int) -> Array:
    """(B, h/2 * w/2, 4C) tokens -> (B, h, w, C) NHWC latents; the inverse of ``pack_latents``."""
    _check_even(h, w, "unpack_latents")
    b, n, c4 = tokens.shape
    if n != (h // 2) * (w // 2) or c4 % 4:
        raise InvalidArgumentError(
            f"unpack_latents: {n} tokens of {c4} channels cannot be a {h}x{w} latent "
            f"(expected {(h // 2) * (w // 2)} tokens of 4C channels)")
    x = tokens.reshape(b, h // 2, w // 2, c4 // 4, 2, 2)  # (B, i, j, C, di, dj)
    return x.transpose(0, 1, 4, 2, 5, 3).reshape(b, h, w, c4 // 4)  # (B, i, di, j, dj, C)


def latent_image_ids(h: int, w: int, index: int = 0) -> np.ndarray:
    """(h/2 * w/2, 3) float32 ids [index, row, col] of the packed tokens of an h x w latent
    (``index`` 1: a Kontext reference image's tokens, as ``FluxKontextPipeline.prepare_latents``)."""
    _check_even(h, w, "latent_image_ids")
    ids = np.full((h // 2, w // 2, 3), index, np.float32)
    ids[..., 1] = np.arange(h // 2, dtype=np.float32)[:, None]
    ids[..., 2] = np.arange(w // 2, dtype=np.float32)[None, :]
    return ids.reshape(-1, 3)


# ----------------------------------------------------------------------------------------------
# Loading


def read_flux_config(folder: str | Path) -> FluxTransformerConfig:
    path = resolve_transformer_dir(folder, "FluxTransformer2DModel") / "config.json"
    return FluxTransformerConfig.from_dict(read_json(path), str(path))


def build_abstract(config: FluxTransformerConfig, stacked: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and a State of ShapeDtypeStructs; costs no FLOPs and no memory.
    ``stacked``: the serving form (``preheat.models.stacking``); the default is the checkpoint's."""
    return weights.build_abstract(lambda rngs: FluxTransformer2DModel(config, rngs=rngs, stacked=stacked))


@dataclass
class FluxTransformer:
    """A loaded Flux transformer. ``apply`` is pure (jit it; weights are an argument)."""

    config: FluxTransformerConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: Any = jnp.float32

    def apply(self, params: nnx.State, hidden_states: Array, encoder_hidden_states: Array,
              pooled_projections: Array, timestep: Array, img_ids: Array, txt_ids: Array,
              guidance: Array | None = None, lora: Any = None) -> Array:
        """diffusers' forward: (B, S, in_channels), (B, T, joint_attention_dim), (B, pooled_projection_dim),
        (B,) sigma (the pipeline's t / 1000), (S, 3), (T, 3), (B,) guidance scale or None -> (B, S, out_channels).

        Activations run in ``self.dtype``; the timestep and guidance sinusoids and rotary angles in float32.
        ``lora``: per-image low-rank adapters (``preheat.models.adapters.Adapters``), or None.
        """
        from preheat.models.adapters import attach

        model = attach(nnx.merge(self.graphdef, upcast(params, self.dtype, tie=hidden_states)), lora)  # fp8-stored weights upcast here

        def act(v: Any) -> Array:
            return jnp.asarray(v).astype(self.dtype)

        return model(act(hidden_states), act(encoder_hidden_states), act(pooled_projections),
                     jnp.asarray(timestep, jnp.float32), jnp.asarray(img_ids, jnp.float32),
                     jnp.asarray(txt_ids, jnp.float32),
                     None if guidance is None else jnp.asarray(guidance, jnp.float32))

    def __call__(self, *args: Any, **kwargs: Any) -> Array:
        return self.apply(self.params, *args, **kwargs)


def build_flux_transformer(config: FluxTransformerConfig, tensors: Mapping[str, Any], dtype: Any = jnp.float32,
                           source: str = "FluxTransformer2DModel weights",
                           options: LoadOptions | None = None) -> FluxTransformer:
    """A loaded transformer from torch-layout tensors keyed like diffusers' state dict (numpy arrays)."""
    dtype = check_dtype(dtype)
    graphdef, abstract = build_abstract(config)
    # a Checkpoint streams (dict() would read it all); weights_dtype: the layers diffusers' layerwise casting casts
    params = fill(abstract, tensors, dtype, source, options=options, low=layerwise(("pos_embed", "norm"), options))
    if scanned(config.num_layers) or scanned(config.num_single_layers):  # weights stacked once, here
        graphdef, params = stack(lambda rngs: FluxTransformer2DModel(config, rngs=rngs, stacked=True), params, options)
    return FluxTransformer(config=config, graphdef=graphdef, params=params, dtype=dtype)


def load_flux_transformer(folder: str | Path, dtype: Any = jnp.float32, variant: str | None = None,
                          options: LoadOptions | None = None) -> FluxTransformer:
    """Load a diffusers ``FluxTransformer2DModel`` folder (or a pipeline folder's ``transformer/``).

    Reads ``diffusion_pytorch_model[.variant].safetensors`` or its shard index (the published
    FLUX.1 folders are sharded); weights are cast to ``dtype`` whatever dtype they were stored in.
    """
    dtype = check_dtype(dtype)
    path = resolve_transformer_dir(folder, "FluxTransformer2DModel")
    config = read_flux_config(path)
    tensors = read_tensors(weight_files(path, (DIFFUSERS_STEM,), variant=variant))
    return build_flux_transformer(config, tensors, dtype, str(path), options)
