"""diffusers' ``SD3Transformer2DModel`` (the MMDiT of Stable Diffusion 3 / 3.5) in JAX (Flax NNX).

The image latent is cut into p x p patches (a stride-p conv) plus a 2-D sin-cos position
embedding; the text (T5 + CLIP hidden states) is projected to the same width. Every
``JointTransformerBlock`` runs one attention over the concatenation [image tokens, text tokens]
with separate projections per stream (``to_q``/``add_q_proj``, ...), each stream modulated by the
timestep + pooled-text embedding through adaLN-Zero. The last block keeps only the image stream
(``context_pre_only``). SD3.5 adds RMS q/k norms (``qk_norm="rms_norm"``); SD3.5-medium adds, in
``dual_attention_layers``, a second image-only self-attention (``attn2``, ``SD35AdaLayerNormZeroX``).

As in ``unet2d``: NHWC at the edges, every submodule named like diffusers' so that a parameter
path *is* its checkpoint key (``transformer_blocks.3.attn.add_k_proj``), built abstractly and
filled from safetensors, weights an argument of the pure ``apply``. Attention goes through
``jax.nn.dot_product_attention`` (cuDNN fused attention on GPUs).

Position embedding: with ``pos_embed_max_size`` (every published SD3 / SD3.5) the checkpoint
holds a (1, M*M, D) table (``pos_embed.pos_embed``), loaded like a weight and centre-cropped to the
latent's (h/p, w/p) grid with static slices; without it, the table is computed on the host for
the latent's grid, as diffusers does.

What is static (the compiled program) and what is data::

    static: the config (architecture_dict), dtype, latent (h, w), text length T, batch
    data:   params, latent, encoder_hidden_states, pooled_projections, timestep
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
from preheat.models.layers import Conv2d, Linear, TimestepEmbedding, lift, sinusoidal_embedding
from preheat.models.stacking import block_runs, run_blocks, scanned, stack
from preheat.models.storage import layerwise, upcast
from preheat.models.safetensors_files import DIFFUSERS_STEM, read_json, read_tensors, weight_files
from preheat.models.weights import LoadOptions, check_dtype, fill, torch_key
from preheat.models.attention import dot_product_attention

__all__ = [
    "SUPPORTED",
    "SD3TransformerConfig",
    "SD3Transformer2DModel",
    "SD3Transformer",
    "load_sd3_transformer",
    "build_sd3_transformer",
    "read_sd3_transformer_config",
    "build_abstract",
    "checkpoint_key",
    "sincos_pos_embed_2d",
]

Array = jax.Array

# Everything SD3-medium, SD3.5-large/-large-turbo and SD3.5-medium use. Anything else is refused by name.
SUPPORTED: dict[str, tuple[Any, ...]] = {
    "_class_name": ("SD3Transformer2DModel",),
    "qk_norm": (None, "rms_norm"),
}

_CLASS = "SD3Transformer2DModel"
_EPS = 1e-6  # every norm of the model: adaLN layer norms, q/k RMS norms, the final norm


@dataclass(frozen=True)
class SD3TransformerConfig(JsonConfig):
    """The architecture, parsed from diffusers' ``config.json`` (same names, same defaults)."""

    sample_size: int = 128  # native latent side; sets the position grid when pos_embed_max_size is None
    patch_size: int = 2  # p: the latent is cut into p x p patches, one token each
    in_channels: int = 16
    num_layers: int = 18  # JointTransformerBlocks; the last is context_pre_only
    attention_head_dim: int = 64
    num_attention_heads: int = 18  # inner width D = heads * head_dim
    joint_attention_dim: int = 4096  # width of encoder_hidden_states (T5 / CLIP concatenated)
    caption_projection_dim: int = 1152  # context_embedder's output width; must equal D
    pooled_projection_dim: int = 2048  # width of pooled_projections (CLIP-L + CLIP-G pooled)
    out_channels: int | None = 16  # None: in_channels
    pos_embed_max_size: int | None = 96  # M: the stored M x M position table, cropped per latent
    dual_attention_layers: tuple[int, ...] = ()  # SD3.5-medium: blocks with a second self-attention
    qk_norm: str | None = None  # "rms_norm" in SD3.5

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "SD3TransformerConfig":
        return cls.from_checked_dict(raw, source, _CLASS)

    def validate(self, source: str = "config") -> None:
        if self.qk_norm not in SUPPORTED["qk_norm"]:
            allowed = ", ".join(repr(v) for v in SUPPORTED["qk_norm"])
            raise UnsupportedConfigError(
                f"unsupported {_CLASS} qk_norm {self.qk_norm!r} in {source}; supported: {allowed}")
        for name in ("sample_size", "patch_size", "in_channels", "num_layers", "attention_head_dim",
                     "num_attention_heads", "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim"):
            _positive(name, getattr(self, name), source)
        if self.out_channels is not None:
            _positive("out_channels", self.out_channels, source)
        if self.pos_embed_max_size is not None:
            _positive("pos_embed_max_size", self.pos_embed_max_size, source)
        if not isinstance(self.dual_attention_layers, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in self.dual_attention_layers):
            raise UnsupportedConfigError(
                f"{source}: dual_attention_layers must be a list of block indices, got {self.dual_attention_layers!r}")
        if self.caption_projection_dim != self.inner_dim:
            raise UnsupportedConfigError(
                f"{source}: caption_projection_dim {self.caption_projection_dim} must equal num_attention_heads x "
                f"attention_head_dim = {self.inner_dim} (text and image tokens share one attention)")
        if self.inner_dim % 4:
            raise UnsupportedConfigError(
                f"{source}: num_attention_heads x attention_head_dim = {self.inner_dim} must be divisible by 4 "
                "(the 2-D sin-cos position embedding)")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def out_dim(self) -> int:
        return self.out_channels if self.out_channels is not None else self.in_channels

    def architecture_dict(self) -> dict[str, Any]:
        """The fields that change the program (for cache keys): all of them."""
        return self.to_dict()


def _positive(name: str, value: Any, source: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedConfigError(f"{source}: {name} must be a positive integer, got {value!r}")


# ----------------------------------------------------------------------------------------------
# Position embedding (host side: shapes are static)


def sincos_pos_embed_2d(dim: int, grid: tuple[int, int], base_size: int,
                        interpolation_scale: float = 1.0) -> np.ndarray:
    """diffusers' ``get_2d_sincos_pos_embed`` for an (h, w) grid -> (h*w, dim) float32, rows row-major.

    Token (r, c) is [sincos(dim/2, column position c), sincos(dim/2, row position r)]: diffusers'
    meshgrid puts the width coordinate first. Positions are float32 as in torch, the sines float64.
    """
    h, w = grid
    pos_h = np.arange(h, dtype=np.float32) / np.float32(h / base_size) / np.float32(interpolation_scale)
    pos_w = np.arange(w, dtype=np.float32) / np.float32(w / base_size) / np.float32(interpolation_scale)
    cols, rows = np.meshgrid(pos_w, pos_h, indexing="xy")  # each (h, w)

    def one_axis(pos: np.ndarray) -> np.ndarray:  # (h*w,) -> (h*w, dim/2)
        half = dim // 4
        omega = 1.0 / 10000 ** (np.arange(half, dtype=np.float64) / (dim / 4.0))  # (dim/4,)
        out = np.outer(pos.reshape(-1).astype(np.float64), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    return np.concatenate([one_axis(cols), one_axis(rows)], axis=1).astype(np.float32)  # (h*w, dim)


# ----------------------------------------------------------------------------------------------
# Norms


class RMSNorm(nnx.Module):
    """diffusers' ``RMSNorm`` with a weight (the q/k norms of SD3.5); mean square in float32."""

    def __init__(self, dim: int, eps: float = _EPS):
        self.weight = weights.param((dim,), lambda: jnp.ones((dim,)))
        self.eps = eps

    def __call__(self, x: Array) -> Array:  # (..., Dh) -> (..., Dh)
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.square(h).mean(axis=-1, keepdims=True) + self.eps)
        return h.astype(x.dtype) * lift(self.weight[...].astype(x.dtype), x.ndim)


class AdaLayerNormZero(nnx.Module):
    """adaLN-Zero: one linear of silu(temb) gives shift/scale/gate for attention and MLP.

    ``chunks=9`` is SD3.5's ``SD35AdaLayerNormZeroX`` (a second shift/scale/gate for ``attn2``).
    """

    def __init__(self, dim: int, chunks: int = 6, *, rngs: nnx.Rngs):
        self.linear = Linear(dim, chunks * dim, rngs=rngs)
        self.chunks = chunks

    def __call__(self, x: Array, temb: Array) -> tuple[Array, tuple[Array, ...], Array | None]:
        """(B, L, D), (B, D) -> modulated x, the chunks (each (B, D)) in diffusers' order, and for
        ``chunks=9`` the same normed x under the second shift/scale (``attn2``'s input), else None."""
        mods = jnp.split(self.linear(jax.nn.silu(temb)), self.chunks, axis=-1)
        normed = layer_norm(x)
        second = modulate(normed, mods[6], mods[7]) if self.chunks == 9 else None
        return modulate(normed, mods[0], mods[1]), tuple(mods), second


# ----------------------------------------------------------------------------------------------
# Attention and feed-forward


class JointAttention(nnx.Module):
    """diffusers' ``Attention`` with ``JointAttnProcessor2_0``.

    ``context`` given (``added_kv``): one softmax over [image; text] tokens, each stream with its own
    q/k/v (``to_*`` / ``add_*_proj``) and q/k norms; the text output goes through ``to_add_out``
    unless ``context_pre_only``. Without ``added_kv`` (``attn2``): plain self-attention on the image.
    """

    def __init__(self, dim: int, heads: int, head_dim: int, *, added_kv: bool, context_pre_only: bool,
                 qk_norm: str | None, rngs: nnx.Rngs):
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q = Linear(dim, inner, rngs=rngs)
        self.to_k = Linear(dim, inner, rngs=rngs)
        self.to_v = Linear(dim, inner, rngs=rngs)
        rms = qk_norm == "rms_norm"
        self.norm_q = RMSNorm(head_dim) if rms else None
        self.norm_k = RMSNorm(head_dim) if rms else None
        if added_kv:
            self.add_q_proj = Linear(dim, inner, rngs=rngs)
            self.add_k_proj = Linear(dim, inner, rngs=rngs)
            self.add_v_proj = Linear(dim, inner, rngs=rngs)
            self.norm_added_q = RMSNorm(head_dim) if rms else None
            self.norm_added_k = RMSNorm(head_dim) if rms else None
            self.to_add_out = None if context_pre_only else Linear(inner, dim, rngs=rngs)
        else:
            self.add_q_proj = self.add_k_proj = self.add_v_proj = None
            self.norm_added_q = self.norm_added_k = self.to_add_out = None
        self.to_out = nnx.List([Linear(inner, dim, rngs=rngs)])  # to_out.1 is dropout in torch

    def _qkv(self, x: Array, q: Linear, k: Linear, v: Linear, nq: RMSNorm | None,
             nk: RMSNorm | None) -> tuple[Array, Array, Array]:
        b, n, _ = x.shape

        def split(y: Array) -> Array:  # (B, N, nH*Dh) -> (B, N, nH, Dh)
            return y.reshape(b, n, self.heads, self.head_dim)

        qh, kh, vh = split(q(x)), split(k(x)), split(v(x))
        if nq is not None:
            qh, kh = nq(qh), nk(kh)
        return qh, kh, vh

    def __call__(self, x: Array, context: Array | None = None) -> tuple[Array, Array | None]:
        """(B, N, D) image, (B, T, D) text -> image (B, N, D), text (B, T, D) or None."""
        b, n, _ = x.shape
        q, k, v = self._qkv(x, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k)  # (B, N, nH, Dh)
        if context is not None:
            cq, ck, cv = self._qkv(context, self.add_q_proj, self.add_k_proj, self.add_v_proj, self.norm_added_q,
                                   self.norm_added_k)  # (B, T, nH, Dh)
            q = jnp.concatenate([q, cq], axis=1)  # (B, N+T, nH, Dh): image tokens first
            k = jnp.concatenate([k, ck], axis=1)
            v = jnp.concatenate([v, cv], axis=1)
        out = dot_product_attention(q, k, v)  # (B, N(+T), nH, Dh); scale 1/sqrt(Dh)
        out = out.astype(x.dtype).reshape(b, out.shape[1], self.heads * self.head_dim)
        image = self.to_out[0](out[:, :n])
        if context is None:
            return image, None
        text = out[:, n:]
        return image, (self.to_add_out(text) if self.to_add_out is not None else text)


class JointTransformerBlock(nnx.Module):
    """The MMDiT block: joint attention, then a gated MLP per stream (the text's skipped when
    ``context_pre_only``, the last block); ``dual`` adds SD3.5's image-only ``attn2``."""

    def __init__(self, dim: int, heads: int, head_dim: int, *, context_pre_only: bool, qk_norm: str | None,
                 dual: bool, rngs: nnx.Rngs):
        self.norm1 = AdaLayerNormZero(dim, 9 if dual else 6, rngs=rngs)
        self.norm1_context = (AdaLayerNormContinuous(dim, dim, rngs=rngs) if context_pre_only
                              else AdaLayerNormZero(dim, rngs=rngs))
        self.attn = JointAttention(dim, heads, head_dim, added_kv=True, context_pre_only=context_pre_only,
                                   qk_norm=qk_norm, rngs=rngs)
        self.attn2 = JointAttention(dim, heads, head_dim, added_kv=False, context_pre_only=False, qk_norm=qk_norm,
                                    rngs=rngs) if dual else None
        self.ff = FeedForward(dim, rngs=rngs)  # norm2 / norm2_context: layer norms without weights
        self.ff_context = None if context_pre_only else FeedForward(dim, rngs=rngs)
        self.context_pre_only = context_pre_only

    def __call__(self, x: Array, context: Array, temb: Array) -> tuple[Array, Array | None]:
        """(B, N, D) image, (B, T, D) text, (B, D) -> image, text (None after the last block)."""
        nx, m, nx2 = self.norm1(x, temb)
        _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = m[:6]  # each (B, D); m[8]: attn2's gate
        if self.context_pre_only:
            nc = self.norm1_context(context, temb)
        else:
            nc, cm, _ = self.norm1_context(context, temb)
        attn, attn_ctx = self.attn(nx, nc)  # (B, N, D), (B, T, D)
        x = x + gate_msa[:, None, :] * attn
        if self.attn2 is not None:
            x = x + m[8][:, None, :] * self.attn2(nx2)[0]
        x = x + gate_mlp[:, None, :] * self.ff(modulate(layer_norm(x), shift_mlp, scale_mlp))
        if self.context_pre_only:
            return x, None
        _, _, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = cm
        context = context + c_gate_msa[:, None, :] * attn_ctx
        ff_ctx = self.ff_context(modulate(layer_norm(context), c_shift_mlp, c_scale_mlp))
        return x, context + c_gate_mlp[:, None, :] * ff_ctx


# ----------------------------------------------------------------------------------------------
# Embeddings


class PatchEmbed(nnx.Module):
    """A stride-p p x p conv (``proj``) to D-wide tokens, plus the 2-D sin-cos position embedding.

    With ``max_size`` M the (1, M*M, D) table is a checkpoint tensor (``pos_embed.pos_embed``),
    centre-cropped per latent (diffusers' ``cropped_pos_embed``); without it the table is computed
    for the latent's grid with ``base_size = sample_size // p``.
    """

    def __init__(self, c: SD3TransformerConfig, *, rngs: nnx.Rngs):
        self.proj = Conv2d(c.in_channels, c.inner_dim, c.patch_size, stride=c.patch_size, rngs=rngs)
        m = c.pos_embed_max_size
        # Filled from the checkpoint; never computed here (the build is abstract).
        self.pos_embed = weights.param((1, m * m, c.inner_dim), lambda: jnp.zeros((1, m * m, c.inner_dim))) if m is not None else None
        self.patch_size, self.max_size = c.patch_size, m
        self.base_size = c.sample_size // c.patch_size
        self.dim = c.inner_dim

    def position_embedding(self, h: int, w: int) -> Array:
        """(1, h*w, D) for an (h, w) token grid, as static slices or a host constant."""
        if self.max_size is None:
            return jnp.asarray(sincos_pos_embed_2d(self.dim, (h, w), self.base_size))[None]
        m = self.max_size
        top, left = (m - h) // 2, (m - w) // 2
        table = self.pos_embed[...].reshape(m, m, self.dim)
        return table[top:top + h, left:left + w].reshape(1, h * w, self.dim)

    def __call__(self, x: Array) -> Array:  # (B, H, W, C) -> (B, H/p * W/p, D), tokens row-major
        y = self.proj(x)  # (B, H/p, W/p, D)
        b, h, w, d = y.shape
        return (y.reshape(b, h * w, d) + self.position_embedding(h, w).astype(y.dtype)).astype(x.dtype)


class CombinedTimestepTextProjEmbeddings(nnx.Module):
    """temb = MLP(256 sinusoidal features of t) + MLP(pooled text).

    ``text_embedder`` is diffusers' ``PixArtAlphaTextProjection(act_fn="silu")``: the same
    linear_1 / silu / linear_2 as ``TimestepEmbedding``, so that class serves both.
    """

    def __init__(self, dim: int, pooled_dim: int, *, rngs: nnx.Rngs):
        self.timestep_embedder = TimestepEmbedding(256, dim, rngs=rngs)  # time_proj: sinusoidal, no weights
        self.text_embedder = TimestepEmbedding(pooled_dim, dim, rngs=rngs)

    def __call__(self, t: Array, pooled: Array) -> Array:  # (B,), (B, P) -> (B, D)
        t_feat = sinusoidal_embedding(t, 256, flip_sin_to_cos=True, freq_shift=0)  # (B, 256) float32
        return self.timestep_embedder(t_feat.astype(pooled.dtype)) + self.text_embedder(pooled)


# ----------------------------------------------------------------------------------------------


class SD3Transformer2DModel(nnx.Module):
    """The network. ``__call__`` is NHWC; ``SD3Transformer`` is the loaded wrapper."""

    def __init__(self, config: SD3TransformerConfig, *, rngs: nnx.Rngs, stacked: bool = False):
        """``stacked``: the serving form, each run of 3+ like blocks one scanned ``stacking.BlockStack``."""
        c = config
        c.validate()
        self.config = c
        d = c.inner_dim
        self.pos_embed = PatchEmbed(c, rngs=rngs)
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(d, c.pooled_projection_dim, rngs=rngs)
        self.context_embedder = Linear(c.joint_attention_dim, c.caption_projection_dim, rngs=rngs)
        def block(i: int) -> JointTransformerBlock:
            return JointTransformerBlock(d, c.num_attention_heads, c.attention_head_dim,
                                         context_pre_only=i == c.num_layers - 1, qk_norm=c.qk_norm,
                                         dual=i in c.dual_attention_layers, rngs=rngs)

        self.transformer_blocks = block_runs(block, block_kinds(c), stacked)
        self.norm_out = AdaLayerNormContinuous(d, d, rngs=rngs)
        self.proj_out = Linear(d, c.patch_size * c.patch_size * c.out_dim, rngs=rngs)

    def check_inputs(self, x: Array, context: Array, pooled: Array, t: Array) -> None:
        """Shapes are static under jit: a wrong one is a one-line error at trace time."""
        c = self.config
        if x.ndim != 4 or x.shape[-1] != c.in_channels:
            raise InvalidArgumentError(f"latent must be (B, h, w, {c.in_channels}) NHWC, got shape {tuple(x.shape)}")
        b, h, w, _ = x.shape
        p = c.patch_size
        if h % p or w % p:
            raise InvalidArgumentError(f"latent height and width must be multiples of patch_size {p}, got {h}x{w}")
        m = c.pos_embed_max_size
        if m is not None and (h // p > m or w // p > m):
            raise InvalidArgumentError(
                f"latent {h}x{w} is {h // p}x{w // p} patches, more than pos_embed_max_size {m} per side")
        if context.ndim != 3 or context.shape[0] != b or context.shape[-1] != c.joint_attention_dim:
            raise InvalidArgumentError(
                f"encoder_hidden_states must be ({b}, T, {c.joint_attention_dim}), got shape {tuple(context.shape)}")
        if pooled.ndim != 2 or pooled.shape != (b, c.pooled_projection_dim):
            raise InvalidArgumentError(
                f"pooled_projections must be ({b}, {c.pooled_projection_dim}), got shape {tuple(pooled.shape)}")
        if jnp.ndim(t) not in (0, 1) or (jnp.ndim(t) == 1 and jnp.shape(t)[0] not in (1, b)):
            raise InvalidArgumentError(f"timestep must be a scalar or ({b},), got shape {tuple(jnp.shape(t))}")

    def __call__(self, x: Array, context: Array, pooled: Array, t: Array, skip_layers: tuple[int, ...] = ()) -> Array:
        """(B, h, w, C) latent, (B, T, J) text, (B, P) pooled text, (B,) t in [0, 1000] -> (B, h, w, Cout).

        ``skip_layers``: block indices to leave out (SD3.5's skip-layer guidance); static.
        """
        self.check_inputs(x, context, pooled, t)
        bad = [i for i in skip_layers if not 0 <= i < self.config.num_layers]
        if bad:
            raise InvalidArgumentError(
                f"skip_layers {bad} out of range: this transformer has blocks 0..{self.config.num_layers - 1}")
        c = self.config
        b, h, w, _ = x.shape
        p = c.patch_size
        t = jnp.broadcast_to(jnp.asarray(t, jnp.float32).reshape(-1), (b,))
        hidden = self.pos_embed(x)  # (B, N, D), N = h/p * w/p
        temb = self.time_text_embed(t, pooled.astype(x.dtype))  # (B, D)
        ctx = self.context_embedder(context.astype(x.dtype))  # (B, T, D)
        hidden, ctx = run_blocks(self.transformer_blocks, (hidden, ctx),
                                 lambda block, carry: block(carry[0], carry[1], temb), skip=tuple(skip_layers))
        out = self.proj_out(self.norm_out(hidden, temb))  # (B, N, p*p*Cout)
        out = out.reshape(b, h // p, w // p, p, p, c.out_dim)  # (B, h/p, w/p, p, q, Cout)
        return out.transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, c.out_dim)  # (B, h, w, Cout)


# ----------------------------------------------------------------------------------------------
# Loading


def read_sd3_transformer_config(folder: Path) -> SD3TransformerConfig:
    path = folder / "config.json"
    return SD3TransformerConfig.from_dict(read_json(path), str(path))


def block_kinds(c: SD3TransformerConfig) -> list[tuple[bool, bool]]:
    """Each block's (last, dual): blocks of one kind have the same weights' shapes (``block_runs``)."""
    return [(i == c.num_layers - 1, i in c.dual_attention_layers) for i in range(c.num_layers)]


def build_abstract(config: SD3TransformerConfig, stacked: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and a State of ShapeDtypeStructs; costs no FLOPs and no memory.
    ``stacked``: the serving form (``preheat.models.stacking``); the default is the checkpoint's."""
    return weights.build_abstract(lambda rngs: SD3Transformer2DModel(config, rngs=rngs, stacked=stacked))


def checkpoint_key(path: tuple[Any, ...]) -> str:
    """NNX parameter path -> diffusers state-dict key (the position table keeps its own leaf name)."""
    if str(path[-1]) == "pos_embed":  # PatchEmbed's buffer: pos_embed.pos_embed, (1, M*M, D)
        return ".".join(str(p) for p in path)
    return torch_key(path)


@dataclass
class SD3Transformer:
    """A loaded SD3 transformer. ``apply`` is the pure NHWC function a sampler compiles, the
    weights an argument so that one program serves every fine-tune; ``__call__`` mirrors
    diffusers' NCHW ``.sample``."""

    config: SD3TransformerConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        # What __call__ runs: compiled once per input shape (op-by-op dispatch is many times slower).
        self._compiled_apply = jax.jit(self.apply, static_argnames=("skip_layers",))

    def apply(self, params: nnx.State, x: Array, encoder_hidden_states: Array, pooled_projections: Array,
              timestep: Array, skip_layers: tuple[int, ...] = (), lora: Any = None) -> Array:
        """(B, h, w, C) latent, (B, T, joint_attention_dim), (B, pooled_projection_dim), (B,) float
        timestep in [0, 1000] (what diffusers' SD3 pipeline passes) -> (B, h, w, out_channels).

        ``skip_layers`` (diffusers' argument of the same name, for skip-layer guidance) is static:
        close over it or mark it static under jit. ``lora``: per-image low-rank adapters
        (``preheat.models.adapters.Adapters``), or None.
        """
        from preheat.models.adapters import attach

        x = jnp.asarray(x).astype(self.dtype)
        model = attach(nnx.merge(self.graphdef, upcast(params, self.dtype, tie=x)), lora)  # fp8-stored weights upcast here
        return model(x, jnp.asarray(encoder_hidden_states), jnp.asarray(pooled_projections), timestep,
                     tuple(skip_layers))

    def __call__(self, hidden_states: Any, encoder_hidden_states: Any, pooled_projections: Any,
                 timestep: Any, skip_layers: tuple[int, ...] = ()) -> Array:
        x = jnp.asarray(hidden_states, self.dtype)
        if x.ndim != 4:
            raise InvalidArgumentError(f"hidden_states must be (B, C, H, W), got shape {tuple(x.shape)}")
        out = self._compiled_apply(self.params, jnp.transpose(x, (0, 2, 3, 1)),
                                   jnp.asarray(encoder_hidden_states, self.dtype),
                                   jnp.asarray(pooled_projections, self.dtype), jnp.asarray(timestep, jnp.float32),
                                   skip_layers=tuple(skip_layers))
        return jnp.transpose(out, (0, 3, 1, 2))  # NHWC -> NCHW


def build_sd3_transformer(config: SD3TransformerConfig, tensors: Mapping[str, Any], dtype: Any = jnp.float32,
                          source: str = f"{_CLASS} weights", options: LoadOptions | None = None) -> SD3Transformer:
    """A loaded transformer from torch-layout tensors keyed like diffusers' state dict (numpy arrays)."""
    dtype = check_dtype(dtype)
    graphdef, abstract = build_abstract(config)
    params = fill(abstract, tensors, dtype, source, key_fn=checkpoint_key, options=options,  # a Checkpoint streams
                  low=layerwise(("pos_embed", "norm"), options))  # diffusers' SD3Transformer2DModel skips these too
    kinds = block_kinds(config)
    if any(scanned(sum(1 for k in kinds if k == kind)) for kind in set(kinds)):  # weights stacked once, here
        graphdef, params = stack(lambda rngs: SD3Transformer2DModel(config, rngs=rngs, stacked=True), params, options)
    return SD3Transformer(config=config, graphdef=graphdef, params=params, dtype=dtype)


def load_sd3_transformer(folder: str | Path, dtype: Any = jnp.float32, variant: str | None = None,
                         options: LoadOptions | None = None) -> SD3Transformer:
    """Load a diffusers ``SD3Transformer2DModel`` folder (or a pipeline folder's ``transformer/``).

    One safetensors file or a shard index with its shards; ``variant="fp16"`` reads
    ``diffusion_pytorch_model.fp16.safetensors[.index.json]``. Weights are cast to ``dtype``.
    """
    dtype = check_dtype(dtype)
    folder = resolve_transformer_dir(folder, _CLASS)
    config = read_sd3_transformer_config(folder)
    tensors = read_tensors(weight_files(folder, (DIFFUSERS_STEM,), variant=variant))
    return build_sd3_transformer(config, tensors, dtype, str(folder), options)
