"""transformers' CLIP text encoders in JAX (Flax NNX): ``CLIPTextModel`` and ``CLIPTextModelWithProjection``.

These are the prompt encoders of Stable Diffusion: SD 1.x/2.x and SDXL's first encoder are
``CLIPTextModel``; SDXL's second is ``CLIPTextModelWithProjection`` (its ``text_embeds`` feed
the UNet's pooled "text_time" conditioning). transformers v5 removed its Flax CLIP, so this is
the maintained JAX copy, numerically matching the torch original.

Submodules are named like transformers' so a parameter path *is* the checkpoint key::

    text_model.embeddings.token_embedding.weight       (V, D)
    text_model.embeddings.position_embedding.weight    (P, D)
    text_model.encoder.layers.N.layer_norm1.{weight,bias}
    text_model.encoder.layers.N.self_attn.{q,k,v,out}_proj.{weight,bias}
    text_model.encoder.layers.N.layer_norm2.{weight,bias}
    text_model.encoder.layers.N.mlp.fc{1,2}.{weight,bias}
    text_model.final_layer_norm.{weight,bias}
    text_projection.weight                             (P, D), WithProjection only, no bias

Loaded, the layers (3 or more: ``stacking.scan_min``) are one scanned ``stacking.BlockStack``,
``text_model.encoder.layers.stacked.…`` with a leading (N,) axis, stacked once after the reads:
the encode stage compiles one layer, not N; the scan's per-layer outputs are ``hidden_states``.

Every published diffusers folder (saved by transformers 4.x) uses these keys for both classes.
transformers 5.x saves a plain ``CLIPTextModel`` without the ``text_model.`` prefix; both layouts
load (``checkpoint_key``). The ``position_ids`` buffer some checkpoints carry is ignored.

What is static (the compiled program) and what is data::

    static: the config (architecture_dict), dtype, sequence length (77 for SD)
    data:   params (weights, so one executable serves every fine-tune), input_ids
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from preheat.errors import InvalidArgumentError, ModelNotFoundError, UnsupportedConfigError
from preheat.models import weights
from preheat.models.config import JsonConfig
from preheat.models.layers import Embedding, LayerNorm, Linear
from preheat.models.safetensors_files import TRANSFORMERS_STEM, read_json, read_tensors, weight_files
from preheat.models.stacking import BlockStack, blocks, scanned, stack
from preheat.models.weights import LoadOptions, check_dtype, fill
from preheat.models.attention import dot_product_attention

__all__ = [
    "SUPPORTED",
    "CLIPTextConfig",
    "CLIPTextOutput",
    "CLIPTextTransformer",
    "CLIPTextModel",
    "LayerNorm",
    "CLIPText",
    "load_clip_text",
    "read_clip_config",
    "build_abstract",
    "checkpoint_key",
    "hidden_state_from_end",
    "LEGACY_EOS_TOKEN_ID",
]

Array = jax.Array

# Everything published SD / SDXL text encoders use. Anything else is refused by name.
SUPPORTED: dict[str, tuple[Any, ...]] = {
    "architectures": ("CLIPTextModel", "CLIPTextModelWithProjection"),
    "hidden_act": ("quick_gelu", "gelu"),
    "model_type": ("clip_text_model",),
}

# transformers' pooled output takes argmax(input_ids) when eos_token_id is this value: configs
# written before transformers PR #24773 say 2, and the highest id (<|endoftext|>) is the EOS.
LEGACY_EOS_TOKEN_ID = 2

# Fields that do not change the program (ids used only by tokenizers, training-only values).
_BOOKKEEPING = {"bos_token_id", "pad_token_id"}


@dataclass(frozen=True)
class CLIPTextConfig(JsonConfig):
    """transformers' ``CLIPTextConfig`` (same names, same defaults); other keys are bookkeeping."""

    vocab_size: int = 49408
    hidden_size: int = 512  # D, the width of every hidden state
    intermediate_size: int = 2048  # MLP width
    projection_dim: int = 512  # P, text_embeds width (WithProjection only)
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77  # longest input_ids; SD always uses 77
    hidden_act: str = "quick_gelu"  # CLIP ViT-L (SD 1.x): quick_gelu; OpenCLIP (SD 2.x, SDXL bigG): gelu
    layer_norm_eps: float = 1e-5
    pad_token_id: int | None = 1
    bos_token_id: int | None = 49406
    eos_token_id: int | None = 49407  # picks the pooled position (see LEGACY_EOS_TOKEN_ID)
    model_class: str = "CLIPTextModel"  # from ``architectures``: decides text_projection

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "CLIPTextConfig":
        model_type = raw.get("model_type", "clip_text_model")
        if model_type not in SUPPORTED["model_type"]:
            raise UnsupportedConfigError(
                f"unsupported model_type {model_type!r} in {source}; supported: 'clip_text_model' "
                "(the text_encoder folder of a diffusers pipeline)")
        if "_class_name" in raw and raw["_class_name"] not in SUPPORTED["architectures"]:
            raise UnsupportedConfigError(
                f"unsupported model class {raw['_class_name']!r} in {source}; supported: "
                + ", ".join(repr(a) for a in SUPPORTED["architectures"]))
        values = dict(raw)
        archs = raw.get("architectures")
        if archs is not None:
            if not isinstance(archs, list) or len(archs) != 1:
                raise UnsupportedConfigError(f"{source}: 'architectures' must name one class, got {archs!r}")
            values["model_class"] = archs[0]
        return cls.from_checked_dict(values, source, None, strict=False)

    def validate(self, source: str = "config") -> None:
        if self.model_class not in SUPPORTED["architectures"]:
            raise UnsupportedConfigError(
                f"unsupported model class {self.model_class!r} in {source}; supported: "
                + ", ".join(repr(a) for a in SUPPORTED["architectures"]))
        if self.hidden_act not in SUPPORTED["hidden_act"]:
            raise UnsupportedConfigError(
                f"unsupported hidden_act {self.hidden_act!r} in {source}; supported: "
                + ", ".join(repr(a) for a in SUPPORTED["hidden_act"]))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "projection_dim", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UnsupportedConfigError(f"{source}: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.eos_token_id, int) or isinstance(self.eos_token_id, bool):
            raise UnsupportedConfigError(
                f"{source}: eos_token_id must be an integer (the pooled output is read at the EOS token), "
                f"got {self.eos_token_id!r}")
        if self.hidden_size % self.num_attention_heads:
            raise UnsupportedConfigError(
                f"{source}: hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}")

    @property
    def with_projection(self) -> bool:
        return self.model_class == "CLIPTextModelWithProjection"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def architecture_dict(self) -> dict[str, Any]:
        """The fields that change the program (for cache keys): everything but tokenizer ids."""
        return {k: v for k, v in self.to_dict().items() if k not in _BOOKKEEPING}


class CLIPTextOutput(NamedTuple):
    """What transformers returns with ``output_hidden_states=True``, as arrays."""

    last_hidden_state: Array  # (B, L, D), after final_layer_norm (SD 1.x / 2.x prompt embeddings)
    hidden_states: tuple[Array, ...]  # num_layers + 1 of (B, L, D): embeddings, then each layer; no final LN
    pooled: Array  # (B, D), last_hidden_state at the EOS position
    text_embeds: Array | None  # (B, P), text_projection(pooled); WithProjection only


# ----------------------------------------------------------------------------------------------
# Layers


def _activation(name: str) -> Callable[[Array], Array]:
    return {
        "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    }[name]


class _LinearNoBias(nnx.Module):
    """``nn.Linear(..., bias=False)``: CLIP's text_projection."""

    def __init__(self, cin: int, cout: int, *, rngs: nnx.Rngs):
        self.kernel = weights.param((cin, cout), lambda: jax.random.uniform(rngs.params(), (cin, cout), minval=-1, maxval=1)
                                     / math.sqrt(cin))

    def __call__(self, x: Array) -> Array:  # (..., Cin) -> (..., Cout)
        return x @ self.kernel[...].astype(x.dtype)


class CLIPAttention(nnx.Module):
    """Causal multi-head self-attention through ``jax.nn.dot_product_attention`` (cuDNN-fusable)."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.head_dim = dim // heads
        self.q_proj = Linear(dim, dim, rngs=rngs)
        self.k_proj = Linear(dim, dim, rngs=rngs)
        self.v_proj = Linear(dim, dim, rngs=rngs)
        self.out_proj = Linear(dim, dim, rngs=rngs)

    def __call__(self, x: Array) -> Array:  # (B, L, D) -> (B, L, D)
        b, length, dim = x.shape

        def split(y: Array) -> Array:  # (B, L, D) -> (B, L, nH, Dh)
            return y.reshape(b, length, self.heads, self.head_dim)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        # XLA's implementation takes the softmax in float32 for every input dtype.
        out = dot_product_attention(q, k, v, is_causal=True)  # (B, L, nH, Dh)
        return self.out_proj(out.reshape(b, length, dim))


class CLIPMLP(nnx.Module):
    def __init__(self, dim: int, hidden: int, act: str, *, rngs: nnx.Rngs):
        self.fc1 = Linear(dim, hidden, rngs=rngs)
        self.fc2 = Linear(hidden, dim, rngs=rngs)
        self.act = _activation(act)

    def __call__(self, x: Array) -> Array:  # (B, L, D) -> (B, L, D)
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    """Pre-LN transformer layer: x + attn(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, c: CLIPTextConfig, *, rngs: nnx.Rngs):
        self.layer_norm1 = LayerNorm(c.hidden_size, c.layer_norm_eps)
        self.self_attn = CLIPAttention(c.hidden_size, c.num_attention_heads, rngs=rngs)
        self.layer_norm2 = LayerNorm(c.hidden_size, c.layer_norm_eps)
        self.mlp = CLIPMLP(c.hidden_size, c.intermediate_size, c.hidden_act, rngs=rngs)

    def __call__(self, x: Array) -> Array:  # (B, L, D) -> (B, L, D)
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPTextEmbeddings(nnx.Module):
    def __init__(self, c: CLIPTextConfig, *, rngs: nnx.Rngs):
        self.token_embedding = Embedding(c.vocab_size, c.hidden_size, rngs=rngs)
        self.position_embedding = Embedding(c.max_position_embeddings, c.hidden_size, rngs=rngs)

    def __call__(self, ids: Array) -> Array:  # (B, L) int -> (B, L, D)
        pos = self.position_embedding(jnp.arange(ids.shape[1]))  # (L, D)
        return self.token_embedding(ids) + pos[None]


class CLIPEncoder(nnx.Module):
    def __init__(self, c: CLIPTextConfig, *, rngs: nnx.Rngs, stacked: bool = False):
        """``stacked``: the serving form, the layers one scanned ``stacking.BlockStack`` (3+ layers)."""
        self.layers = blocks(lambda: CLIPEncoderLayer(c, rngs=rngs), c.num_hidden_layers, stacked)

    def __call__(self, h: Array) -> list[Array]:
        """(B, L, D) embeddings -> [h, then each layer's output]: num_layers + 1 of (B, L, D)."""
        if isinstance(self.layers, BlockStack):  # one scan; its ys are the per-layer states
            _, ys = self.layers.run(h, lambda layer, x: layer(x), emit=True)  # (N, B, L, D)
            return [h, *(ys[i] for i in range(self.layers.n))]
        states = [h]
        for layer in self.layers:
            states.append(layer(states[-1]))
        return states


class CLIPTextTransformer(nnx.Module):
    """transformers' ``text_model``: embeddings, encoder, final_layer_norm, pooled EOS state."""

    def __init__(self, c: CLIPTextConfig, *, rngs: nnx.Rngs, stacked: bool = False):
        self.embeddings = CLIPTextEmbeddings(c, rngs=rngs)
        self.encoder = CLIPEncoder(c, rngs=rngs, stacked=stacked)
        self.final_layer_norm = LayerNorm(c.hidden_size, c.layer_norm_eps)
        self.eos_token_id = c.eos_token_id

    def __call__(self, ids: Array, dtype: Any) -> tuple[Array, tuple[Array, ...], Array]:
        """(B, L) ids -> last_hidden_state (B, L, D), hidden_states, pooled (B, D)."""
        states = self.encoder(self.embeddings(ids).astype(dtype))  # num_layers + 1 of (B, L, D)
        last = self.final_layer_norm(states[-1])
        ids32 = ids.astype(jnp.int32)
        if self.eos_token_id == LEGACY_EOS_TOKEN_ID:
            eos = jnp.argmax(ids32, axis=-1)  # (B,) the highest id, <|endoftext|> in CLIP's vocab
        else:
            eos = jnp.argmax((ids32 == self.eos_token_id).astype(jnp.int32), axis=-1)  # (B,) first EOS (0 if none)
        pooled = jnp.take_along_axis(last, eos[:, None, None], axis=1)[:, 0]  # (B, D)
        return last, tuple(states), pooled


class CLIPTextModel(nnx.Module):
    """Both classes: ``text_model`` plus, for CLIPTextModelWithProjection, ``text_projection``."""

    def __init__(self, config: CLIPTextConfig, *, rngs: nnx.Rngs, stacked: bool = False):
        """``stacked``: the serving form (``preheat.models.stacking``); the default is the checkpoint's."""
        config.validate()
        self.config = config
        self.text_model = CLIPTextTransformer(config, rngs=rngs, stacked=stacked)
        self.text_projection = (_LinearNoBias(config.hidden_size, config.projection_dim, rngs=rngs)
                                if config.with_projection else None)

    def __call__(self, input_ids: Array, dtype: Any = jnp.float32) -> CLIPTextOutput:
        last, states, pooled = self.text_model(input_ids, dtype)
        embeds = self.text_projection(pooled) if self.text_projection is not None else None
        return CLIPTextOutput(last, states, pooled, embeds)


def hidden_state_from_end(output: CLIPTextOutput, back: int | Array) -> Array:
    """``output.hidden_states[-back]``, with ``back`` an int or one per row (B,) int array (>= 1).

    Each row's state is picked by a chain of selects, so ``back`` is data: every layer's state
    is computed anyway, and no value compiles a new program.
    """
    states = output.hidden_states  # L + 1 of (B, S, D)
    if isinstance(back, int):
        return states[-back]
    index = len(states) - jnp.asarray(back, jnp.int32)  # (B,) position in states
    chosen = states[-1]
    for i, state in enumerate(states[:-1]):
        chosen = jnp.where((index == i)[:, None, None], state, chosen)  # (B, S, D)
    return chosen


# ----------------------------------------------------------------------------------------------
# Loading


def read_clip_config(folder: Path) -> CLIPTextConfig:
    return CLIPTextConfig.from_dict(read_json(folder / "config.json"), str(folder / "config.json"))


def build_abstract(config: CLIPTextConfig, stacked: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and a State of ShapeDtypeStructs; costs no FLOPs and no memory.
    ``stacked``: the serving form (``preheat.models.stacking``); the default is the checkpoint's."""
    return weights.build_abstract(lambda rngs: CLIPTextModel(config, rngs=rngs, stacked=stacked))


def checkpoint_key(key: str) -> str:
    """Either transformers layout -> preheat's: a bare ``embeddings.…`` gets the ``text_model.`` prefix."""
    if key.startswith(("text_model.", "text_projection.")):
        return key
    return f"text_model.{key}"


def _is_buffer(key: str) -> bool:
    return key.endswith("embeddings.position_ids")  # (1, P) arange buffer, not a weight


@dataclass
class CLIPText:
    """A loaded text encoder. ``apply(params, input_ids)`` is pure (jit it; weights are an argument)."""

    config: CLIPTextConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: Any = jnp.float32

    def apply(self, params: nnx.State, input_ids: Array, lora: Any = None) -> CLIPTextOutput:
        """(B, L) int token ids, L <= max_position_embeddings -> CLIPTextOutput.

        ``lora``: per-prompt low-rank adapters (``preheat.models.adapters.Adapters``), or None."""
        if input_ids.ndim != 2:
            raise InvalidArgumentError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise InvalidArgumentError(
                f"input_ids has length {input_ids.shape[1]}, more than max_position_embeddings "
                f"{self.config.max_position_embeddings}")
        from preheat.models.adapters import attach

        from preheat.models.storage import upcast

        model = nnx.merge(self.graphdef, upcast(params, self.dtype))  # offloaded weights moved in (storage.upcast)
        return attach(model, lora)(input_ids, self.dtype)

    def final_layer_norm(self, params: nnx.State, hidden: Array) -> Array:
        """transformers' ``text_model.final_layer_norm`` on any (B, L, D) state."""
        return nnx.merge(self.graphdef, params).text_model.final_layer_norm(hidden)

    def clip_skip(self, params: nnx.State, output: CLIPTextOutput, skip: int | Array) -> Array:
        """diffusers' SD ``clip_skip``: hidden_states[-(skip + 1)] through the final layer norm.

        ``skip``: an int, or one per row (B,) int array -- data, so one program serves every value.
        ``skip=0`` is ``last_hidden_state``. (SDXL instead takes hidden_states[-(skip + 2)] without
        the norm: :func:`hidden_state_from_end` with ``skip + 2``.)
        """
        if isinstance(skip, int):
            n = len(output.hidden_states)
            if isinstance(skip, bool) or not 0 <= skip < n:
                raise InvalidArgumentError(f"clip_skip must be in [0, {n - 1}], got {skip}", argument="clip_skip")
        return self.final_layer_norm(params, hidden_state_from_end(output, skip + 1))

    def __call__(self, input_ids: Any) -> CLIPTextOutput:
        return self.apply(self.params, jnp.asarray(input_ids, jnp.int32))


def load_clip_text(folder: str | Path, dtype: Any = jnp.float32, variant: str | None = None,
                   model_class: str | None = None, options: LoadOptions | None = None) -> CLIPText:
    """Load a transformers CLIP text-encoder folder (``config.json`` + ``model[.variant].safetensors``).

    ``model_class``: the class a pipeline's ``model_index.json`` names for this component; like
    diffusers, it wins over the config's ``architectures``.
    """
    dtype = check_dtype(dtype)
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ModelNotFoundError(f"text encoder folder {folder} does not exist")
    config = read_clip_config(folder)
    if model_class is not None:
        config = replace(config, model_class=model_class)
        config.validate(f"{folder} (model class from model_index.json)")
    graphdef, abstract = build_abstract(config)
    tensors = read_tensors(weight_files(folder, (TRANSFORMERS_STEM,), variant), rename=checkpoint_key)
    params = fill(abstract, tensors, dtype, str(folder), ignore=_is_buffer, options=options)
    if scanned(config.num_hidden_layers):  # the layers scanned: weights stacked once, here
        graphdef, params = stack(lambda rngs: CLIPTextModel(config, rngs=rngs, stacked=True), params, options)
    return CLIPText(config=config, graphdef=graphdef, params=params, dtype=dtype)
