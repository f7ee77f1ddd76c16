"""transformers' ``T5EncoderModel`` in JAX (Flax NNX): the T5 v1.1 prompt encoder of FLUX and SD3.

FLUX's ``text_encoder_2`` and SD3's ``text_encoder_3`` are the encoder half of T5 v1.1 XXL
(gated-GELU feed-forward, RMSNorm, relative position bias, no attention scaling). transformers
v5 removed its Flax T5, so this is the maintained JAX copy, numerically matching the torch one.

Submodules are named like transformers' so a parameter path *is* the checkpoint key::

    shared.weight                                                        (V, D)
    encoder.block.N.layer.0.SelfAttention.{q,k,v}.weight                 (H*Dk, D), no biases anywhere
    encoder.block.N.layer.0.SelfAttention.o.weight                       (D, H*Dk)
    encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight (buckets, H), block 0 only
    encoder.block.N.layer.0.layer_norm.weight                            (D,)
    encoder.block.N.layer.1.DenseReluDense.{wi_0,wi_1}.weight            (F, D) gated; ``wi`` when not
    encoder.block.N.layer.1.DenseReluDense.wo.weight                     (D, F)
    encoder.block.N.layer.1.layer_norm.weight                            (D,)
    encoder.final_layer_norm.weight                                      (D,)

Loaded, blocks 1.. (3 or more: ``stacking.scan_min``) are one scanned ``stacking.BlockStack``,
``encoder.block.1:N.stacked.…`` with a leading (N - 1,) axis, stacked once after the reads; block 0
stays apart, as it alone holds the relative position bias that every block adds.

``encoder.embed_tokens.weight`` is tied to ``shared.weight``: a file may hold either or both.

Block 0's relative position bias (bidirectional buckets, computed on the host for the static
length) is shared by every layer. Like transformers, float16 keeps ``wo`` in float32 (its
``_keep_in_fp32_modules``), so the residual stream is float32 after block 0's feed-forward, and
clamps float16 hidden states to the finite range; bfloat16 and float32 run plain.

What is static (the compiled program) and what is data::

    static: the config (architecture_dict), dtype, sequence length (FLUX 256/512, SD3 256)
    data:   params (weights), input_ids, the optional attention_mask
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preheat.errors import InvalidArgumentError, ModelNotFoundError, UnsupportedConfigError
from preheat.models import weights
from preheat.models.config import JsonConfig
from preheat.models.layers import Embedding, Linear
from preheat.models.safetensors_files import TRANSFORMERS_STEM, read_json, read_tensors, weight_files
from preheat.models.stacking import block_runs, run_blocks, scanned, stack
from preheat.models.storage import upcast
from preheat.models.weights import LoadOptions, check_dtype, fill
from preheat.models.attention import dot_product_attention

__all__ = [
    "SUPPORTED",
    "T5Config",
    "T5EncoderModel",
    "T5Encoder",
    "T5LayerNorm",
    "load_t5_encoder",
    "read_t5_config",
    "build_abstract",
    "relative_position_buckets",
]

Array = jax.Array

# Everything published FLUX / SD3 T5 encoders (and T5 v1.0 / v1.1 encoders generally) use.
SUPPORTED: dict[str, tuple[Any, ...]] = {
    "model_type": ("t5",),  # umt5 has a position bias per layer; refused by name
    "architectures": ("T5EncoderModel",),
    "feed_forward_proj": ("gated-gelu", "relu", "gated-relu", "gated-silu", "gelu", "silu"),
    "is_decoder": (False,),
}

# transformers' ACT2FN entries reached by SUPPORTED["feed_forward_proj"]. "gated-gelu" is gelu_new.
_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),  # tanh approximation
    "silu": jax.nn.silu,
}

# Fields that do not change the program (ids used only for decoding, training-only values).
_BOOKKEEPING = {"pad_token_id", "eos_token_id", "decoder_start_token_id", "dropout_rate"}


@dataclass(frozen=True)
class T5Config(JsonConfig):
    """transformers' ``T5Config`` fields an encoder reads (same names, same defaults); the rest is ignored."""

    vocab_size: int = 32128  # V, rows of ``shared`` (T5 v1.1: 32128, more than the tokenizer's 32100)
    d_model: int = 512  # D, the width of every hidden state (XXL: 4096)
    d_kv: int = 64  # Dk, per-head width; H * Dk need not equal D
    d_ff: int = 2048  # F, feed-forward width (XXL: 10240)
    num_layers: int = 6  # encoder blocks
    num_heads: int = 8  # H
    relative_attention_num_buckets: int = 32  # rows of block 0's relative_attention_bias
    relative_attention_max_distance: int = 128  # distances past this share the last bucket
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"  # "[gated-]act"; T5 v1.1: "gated-gelu" (gelu_new, tanh-approximate)
    is_decoder: bool = False
    pad_token_id: int | None = 0
    eos_token_id: int | None = 1
    decoder_start_token_id: int | None = 0
    dropout_rate: float = 0.1  # training only

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "T5Config":
        model_type = raw.get("model_type", "t5")
        if model_type not in SUPPORTED["model_type"]:
            raise UnsupportedConfigError(
                f"unsupported model_type {model_type!r} in {source}; supported: 't5' (T5EncoderModel)")
        archs = raw.get("architectures")
        if archs is not None and (not isinstance(archs, list) or len(archs) != 1
                                  or archs[0] not in SUPPORTED["architectures"]):
            raise UnsupportedConfigError(
                f"unsupported architectures {archs!r} in {source}; supported: 'T5EncoderModel' "
                "(a diffusers pipeline's text_encoder_2 / text_encoder_3 folder)")
        values = dict(raw)
        eos = values.get("eos_token_id")
        if isinstance(eos, list):  # transformers allows a list; only bookkeeping here
            values["eos_token_id"] = eos[0] if eos else None
        return cls.from_checked_dict(values, source, None, strict=False)

    def validate(self, source: str = "config") -> None:
        for name in ("feed_forward_proj", "is_decoder"):
            value = getattr(self, name)
            if value not in SUPPORTED[name]:
                raise UnsupportedConfigError(
                    f"unsupported {name} {value!r} in {source}; supported: "
                    + ", ".join(repr(a) for a in SUPPORTED[name]))
        for name in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
                     "relative_attention_num_buckets", "relative_attention_max_distance"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UnsupportedConfigError(f"{source}: {name} must be a positive integer, got {value!r}")
        if self.relative_attention_num_buckets < 4:
            raise UnsupportedConfigError(
                f"{source}: relative_attention_num_buckets must be at least 4 (bidirectional, half exact), "
                f"got {self.relative_attention_num_buckets}")
        if not isinstance(self.layer_norm_epsilon, (int, float)) or not self.layer_norm_epsilon > 0:
            raise UnsupportedConfigError(
                f"{source}: layer_norm_epsilon must be positive, got {self.layer_norm_epsilon!r}")

    @property
    def is_gated_act(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    @property
    def dense_act_fn(self) -> str:
        """The activation transformers derives from feed_forward_proj ("gated-gelu" means gelu_new)."""
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else self.feed_forward_proj.split("-")[-1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def architecture_dict(self) -> dict[str, Any]:
        """The fields that change the program (for cache keys): everything but token ids and dropout."""
        return {k: v for k, v in self.to_dict().items() if k not in _BOOKKEEPING}


# ----------------------------------------------------------------------------------------------
# Relative position buckets


@lru_cache(maxsize=32)
def relative_position_buckets(length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """(L, L) int32 bucket of (key - query) position, transformers' bidirectional rule.

    Half the buckets per direction; within a direction, half exact distances and half logarithmic
    bins up to ``max_distance``. Computed in float64 and floored with a 1e-6 guard so that exact
    bin edges (powers of two for T5's 32/128) land where transformers' float32 arithmetic puts
    them on every platform; it matches transformers' table for every (buckets, distance) tested.
    """
    rel = np.arange(length)[None, :] - np.arange(length)[:, None]  # (L, L) key - query
    half = num_buckets // 2
    exact = half // 2
    n = np.abs(rel)
    with np.errstate(divide="ignore"):
        log_bin = np.log(np.maximum(n, 1) / exact) / math.log(max_distance / exact) * (half - exact)
    large = np.minimum(exact + np.floor(log_bin + 1e-6).astype(np.int64), half - 1)
    out = ((rel > 0) * half + np.where(n < exact, n, large)).astype(np.int32)
    out.setflags(write=False)  # cached and shared
    return out


# ----------------------------------------------------------------------------------------------
# Layers


class T5LayerNorm(nnx.Module):
    """RMSNorm: no mean subtraction, no bias; the variance in float32, output in the weight's dtype."""

    def __init__(self, dim: int, eps: float):
        self.scale = weights.param((dim,), lambda: jnp.ones((dim,)))
        self.eps = eps

    def __call__(self, x: Array) -> Array:  # (..., D) -> (..., D)
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.eps)
        w = self.scale[...]
        return w.reshape((1,) * (h.ndim - 1) + w.shape) * h.astype(w.dtype)


def _clamp_fp16(h: Array) -> Array:
    """transformers' float16 guard: clamp to the finite range (1000 inside it when any value is inf)."""
    if h.dtype != jnp.float16:
        return h
    top = float(jnp.finfo(jnp.float16).max)
    limit = jnp.where(jnp.isinf(h).any(), top - 1000, top).astype(h.dtype)
    return jnp.clip(h, -limit, limit)


class T5Attention(nnx.Module):
    """Bidirectional self-attention with an additive position bias and no 1/sqrt(Dk) scaling."""

    def __init__(self, c: T5Config, has_relative_attention_bias: bool, *, rngs: nnx.Rngs):
        inner = c.num_heads * c.d_kv
        self.heads, self.head_dim = c.num_heads, c.d_kv
        self.q = Linear(c.d_model, inner, bias=False, rngs=rngs)
        self.k = Linear(c.d_model, inner, bias=False, rngs=rngs)
        self.v = Linear(c.d_model, inner, bias=False, rngs=rngs)
        self.o = Linear(inner, c.d_model, bias=False, rngs=rngs)
        self.relative_attention_bias = (Embedding(c.relative_attention_num_buckets, c.num_heads, rngs=rngs)
                                        if has_relative_attention_bias else None)

    def __call__(self, x: Array, bias: Array, mask: Array | None) -> Array:
        """x (B, L, D), bias (1, H, L, L), mask (B, 1, 1, L) bool or None -> (B, L, D)."""
        b, length, _ = x.shape

        def split(y: Array) -> Array:  # (B, L, H*Dk) -> (B, L, H, Dk)
            return y.reshape(b, length, self.heads, self.head_dim)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        if q.dtype == jnp.float16:
            # XLA on CPU has no f16 x f16 -> f32 dot; the logits are float32 either way, so float16
            # attention runs in float32 (an unusual dtype for T5, which is published in bf16/fp32).
            q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
        # XLA's implementation takes logits and softmax in float32 for every input dtype.
        out = dot_product_attention(q, k, v, bias=bias, mask=mask, scale=1.0)  # (B, L, H, Dk)
        return self.o(out.reshape(b, length, self.heads * self.head_dim).astype(x.dtype))


class T5DenseActDense(nnx.Module):
    """wo(act(wi(x))); ``wo`` computes in its own dtype (float32 when the model is float16)."""

    def __init__(self, c: T5Config, *, rngs: nnx.Rngs):
        self.wi = Linear(c.d_model, c.d_ff, bias=False, rngs=rngs)
        self.wo = Linear(c.d_ff, c.d_model, bias=False, rngs=rngs)
        self.act = _ACTIVATIONS[c.dense_act_fn]

    def __call__(self, x: Array) -> Array:  # (B, L, D) -> (B, L, D)
        h = self.act(self.wi(x))  # (B, L, F)
        return self.wo(h.astype(self.wo.kernel[...].dtype))


class T5DenseGatedActDense(nnx.Module):
    """wo(act(wi_0(x)) * wi_1(x)): T5 v1.1's gated feed-forward."""

    def __init__(self, c: T5Config, *, rngs: nnx.Rngs):
        self.wi_0 = Linear(c.d_model, c.d_ff, bias=False, rngs=rngs)
        self.wi_1 = Linear(c.d_model, c.d_ff, bias=False, rngs=rngs)
        self.wo = Linear(c.d_ff, c.d_model, bias=False, rngs=rngs)
        self.act = _ACTIVATIONS[c.dense_act_fn]

    def __call__(self, x: Array) -> Array:  # (B, L, D) -> (B, L, D)
        h = self.act(self.wi_0(x)) * self.wi_1(x)  # (B, L, F)
        return self.wo(h.astype(self.wo.kernel[...].dtype))


class T5LayerSelfAttention(nnx.Module):
    def __init__(self, c: T5Config, has_relative_attention_bias: bool, *, rngs: nnx.Rngs):
        self.SelfAttention = T5Attention(c, has_relative_attention_bias, rngs=rngs)
        self.layer_norm = T5LayerNorm(c.d_model, c.layer_norm_epsilon)

    def __call__(self, x: Array, bias: Array, mask: Array | None) -> Array:  # (B, L, D) -> (B, L, D)
        return x + self.SelfAttention(self.layer_norm(x), bias, mask)


class T5LayerFF(nnx.Module):
    def __init__(self, c: T5Config, *, rngs: nnx.Rngs):
        self.DenseReluDense = (T5DenseGatedActDense if c.is_gated_act else T5DenseActDense)(c, rngs=rngs)
        self.layer_norm = T5LayerNorm(c.d_model, c.layer_norm_epsilon)

    def __call__(self, x: Array) -> Array:  # (B, L, D) -> (B, L, D)
        # float16: wo's float32 output promotes the residual stream to float32, as in transformers
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nnx.Module):
    """Pre-norm self-attention then feed-forward, each residual, each clamped in float16."""

    def __init__(self, c: T5Config, has_relative_attention_bias: bool, *, rngs: nnx.Rngs):
        self.layer = nnx.List([T5LayerSelfAttention(c, has_relative_attention_bias, rngs=rngs),
                               T5LayerFF(c, rngs=rngs)])

    def __call__(self, x: Array, bias: Array, mask: Array | None) -> Array:  # (B, L, D) -> (B, L, D)
        x = _clamp_fp16(self.layer[0](x, bias, mask))
        return _clamp_fp16(self.layer[1](x))


class T5Stack(nnx.Module):
    """transformers' ``encoder``: the blocks and final_layer_norm (embed_tokens is ``shared``)."""

    def __init__(self, c: T5Config, *, rngs: nnx.Rngs, stacked: bool = False):
        """``stacked``: blocks 1.. (3+; block 0 alone holds the position bias) one scanned ``BlockStack``."""
        self.config = c
        self.block = block_runs(lambda i: T5Block(c, i == 0, rngs=rngs), [i == 0 for i in range(c.num_layers)],
                                stacked)
        self.final_layer_norm = T5LayerNorm(c.d_model, c.layer_norm_epsilon)

    def position_bias(self, length: int) -> Array:
        """(1, H, L, L) block 0's relative position bias, shared by every block."""
        buckets = relative_position_buckets(length, self.config.relative_attention_num_buckets,
                                            self.config.relative_attention_max_distance)  # (L, L)
        first = self.block["0"] if isinstance(self.block, nnx.Dict) else self.block[0]  # block_runs keys it "0"
        values = first.layer[0].SelfAttention.relative_attention_bias(jnp.asarray(buckets))  # (L, L, H)
        return jnp.transpose(values, (2, 0, 1))[None]

    def __call__(self, h: Array, mask: Array | None) -> Array:  # (B, L, D) -> (B, L, D)
        bias = self.position_bias(h.shape[1])  # (1, H, L, L)
        h = run_blocks(self.block, h, lambda block, x: block(x, bias, mask))  # a scan over blocks 1.. when stacked
        return self.final_layer_norm(h)


class T5EncoderModel(nnx.Module):
    """``shared`` token embedding and the ``encoder`` stack."""

    def __init__(self, config: T5Config, *, rngs: nnx.Rngs, stacked: bool = False):
        """``stacked``: the serving form (``preheat.models.stacking``); the default is the checkpoint's."""
        config.validate()
        self.config = config
        self.shared = Embedding(config.vocab_size, config.d_model, rngs=rngs)
        self.encoder = T5Stack(config, rngs=rngs, stacked=stacked)

    def __call__(self, input_ids: Array, attention_mask: Array | None = None) -> Array:
        """(B, L) int ids, optional (B, L) mask (nonzero: attend) -> last_hidden_state (B, L, D)."""
        h = self.shared(input_ids)  # (B, L, D) in the weights' dtype
        mask = None if attention_mask is None else (attention_mask != 0)[:, None, None, :]  # (B, 1, 1, L)
        return self.encoder(h, mask)


# ----------------------------------------------------------------------------------------------
# Loading


def read_t5_config(folder: Path) -> T5Config:
    return T5Config.from_dict(read_json(folder / "config.json"), str(folder / "config.json"))


def build_abstract(config: T5Config, stacked: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and a State of ShapeDtypeStructs; costs no FLOPs and no memory.
    ``stacked``: the serving form (``preheat.models.stacking``); the default is the checkpoint's."""
    return weights.build_abstract(lambda rngs: T5EncoderModel(config, rngs=rngs, stacked=stacked))


_TIED = "encoder.embed_tokens.weight"


def _untie(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``shared.weight`` from whichever of the two tied keys the file holds (``shared`` wins); a
    scaled fp8 file's scale (``scale_weight``, ``scale_input``: ``preheat.models.scaled_fp8``) goes
    with its weight, so a dropped tied copy leaves no scale without a weight."""
    tied = tensors.pop(_TIED, None)
    scales = {leaf: tensors.pop(f"encoder.embed_tokens.{leaf}", None) for leaf in ("scale_weight", "scale_input")}
    if tied is not None and "shared.weight" not in tensors:
        tensors["shared.weight"] = tied
        tensors.update({f"shared.{leaf}": v for leaf, v in scales.items() if v is not None})
    return tensors


def _dtype_for(dtype: jnp.dtype) -> Callable[[str], Any]:
    """transformers' ``_keep_in_fp32_modules = ["wo"]``: in float16, ``wo`` stays float32."""
    def pick(key: str) -> Any:
        return jnp.float32 if dtype == jnp.float16 and key.endswith(".wo.weight") else dtype
    return pick


@dataclass
class T5Encoder:
    """A loaded T5 encoder. ``apply(params, input_ids)`` is pure (jit it; weights are an argument)."""

    config: T5Config
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: Any = jnp.float32

    def apply(self, params: nnx.State, input_ids: Array, attention_mask: Array | None = None) -> Array:
        """(B, L) int token ids [, (B, L) mask] -> last_hidden_state (B, L, d_model) in the model dtype.

        FLUX and SD3 pass no mask (padding is attended, as in diffusers); a mask of 0/1 (or bool)
        drops padded keys as transformers' ``attention_mask`` does.
        """
        if input_ids.ndim != 2:
            raise InvalidArgumentError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise InvalidArgumentError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, expected {tuple(input_ids.shape)}")
        return nnx.merge(self.graphdef, upcast(params, self.dtype))(input_ids, attention_mask)  # offloaded: moved in

    def __call__(self, input_ids: Any, attention_mask: Any = None) -> Array:
        mask = None if attention_mask is None else jnp.asarray(attention_mask)
        return self.apply(self.params, jnp.asarray(input_ids, jnp.int32), mask)


def load_t5_encoder(folder: str | Path, dtype: Any = jnp.float32, variant: str | None = None,
                    options: LoadOptions | None = None) -> T5Encoder:
    """Load a transformers ``T5EncoderModel`` folder (``config.json`` + ``model[.variant].safetensors``,
    single or sharded with ``model.safetensors.index.json``)."""
    dtype = check_dtype(dtype)
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ModelNotFoundError(f"text encoder folder {folder} does not exist")
    config = read_t5_config(folder)
    graphdef, abstract = build_abstract(config)
    tensors = _untie(read_tensors(weight_files(folder, (TRANSFORMERS_STEM,), variant)))
    params = fill(abstract, tensors, dtype, str(folder), dtype_for=_dtype_for(dtype), options=options)
    if scanned(config.num_layers - 1):  # blocks 1.. scanned: weights stacked once, here
        graphdef, params = stack(lambda rngs: T5EncoderModel(config, rngs=rngs, stacked=True), params, options)
    return T5Encoder(config=config, graphdef=graphdef, params=params, dtype=dtype)
