"""Single-file checkpoints in the original layouts, read through a diffusers folder's configs.

    preheat.load("model.safetensors", config="<diffusers folder>")

A community fine-tune ships as one ``.safetensors`` in the layout of the code that trained it.
Its tensors are renamed to diffusers' names by one placer per layout (``LAYOUTS``), written once
and built from the config folder's block structure, then written as a diffusers folder (the
config folder's configs and tokenizer files, the renamed weights) that every loader reads as it
is. The folder is kept under ``<cache root>/models/single/``, named by the file's and the config
folder's identity, so a restart reads it again without converting.

Layouts:

* ``ldm`` (SD 1.x, SD 2.x): ``model.diffusion_model.*`` (UNet), ``first_stage_model.*`` (VAE), and
  the text encoder: SD 1.x's OpenAI CLIP under ``cond_stage_model.transformer.*``, SD 2.x's OpenCLIP
  ViT-H under ``cond_stage_model.model.*`` (q/k/v stacked; SD 2.x reads the penultimate layer, so the
  blocks past the config's ``num_hidden_layers`` and the projection are dropped, as diffusers does);
* ``sgm`` (SDXL): the same UNet (plus ``label_emb``) and VAE, ``conditioner.embedders.0.transformer.*``
  (CLIP-L) and ``conditioner.embedders.1.model.*`` (OpenCLIP bigG: q/k/v stacked, projection transposed);
* ``sgm-refiner`` (the SDXL refiner): the same UNet and VAE, and OpenCLIP bigG alone as embedder 0,
  ``conditioner.embedders.0.model.*``, read into the refiner folder's ``text_encoder_2``;
* ``bfl`` (FLUX.1): Black Forest Labs' transformer alone (``double_blocks.*``, ``single_blocks.*``,
  ``img_in``, ``txt_in``, ``time_in``, ``vector_in``, ``guidance_in``, ``final_layer``; also under
  ``model.diffusion_model.``), renamed by ``preheat.models.bfl``'s table (the one LoRA files use);
* ``mmdit`` (SD3, SD3.5): Stability's MMDiT (``joint_blocks.N.x_block/context_block``, ``x_embedder``,
  ``context_embedder``, ``t_embedder``, ``y_embedder``, ``final_layer``, ``pos_embed``; SD3.5's q/k
  norms and ``x_block.attn2``), usually under ``model.diffusion_model.``, renamed by
  ``preheat.models.mmdit``'s table.

A FLUX.1 GGUF file (``.gguf``, BFL's keys) is read by ``preheat.models.gguf_file`` (Q8_0 weights as
int8 values beside their per-block scales, Q4_0 ... Q6_K, IQ4_NL and IQ4_XS weights as their blocks,
``X.weight_Q4_K``, kept so on the device) and converted like a ``bfl`` file.

ComfyUI's checkpoints bundle the rest of the pipeline with an ``mmdit`` or ``bfl`` transformer: the
VAE in the LDM layout (``first_stage_model.*``, or ``vae.*`` in ComfyUI's Flux files such as
``flux1-dev-fp8``) and the text encoders in transformers' names under
``text_encoders.{clip_l,clip_g,t5xxl}.transformer.*`` (SD3: CLIP-L, CLIP-G, T5; FLUX.1: CLIP-L, T5).
Components a file does not fill keep the config folder's weights (linked, not copied), so a
transformer-only file, or an SD3 file without T5, reads the rest from the folder; ``variant``
picks which of the folder's weights (``_taken``), linked under the default names, so the
converted folder has no variants. It records what it was made from (``preheat.files.MADE_FROM``:
the file, the config folder's weights, and its configs and tokenizer files by content): the store's
garbage collection removes it with the snapshot it links once no ref names that, and once one of
them changed (an edited config JSON names another conversion).

A UNet's transformer ``proj_in``/``proj_out`` are 1x1 convolutions ([O, I, 1, 1]) in SD 1.x files and
linear layers ([O, I]) in SD 2.x / SDXL files; either is written as the config's
``use_linear_projection`` holds it (the same map either way).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from preheat.errors import (CheckpointMismatchError, InvalidArgumentError, ModelFormatError, ModelNotFoundError,
                            WeightsError)
from preheat.files import MADE_FROM, publish_folder, write_made_from
from preheat.models.bfl import Piece, bfl_modules, flux_widths
from preheat.models.gguf_file import GGUFTensors, is_gguf
from preheat.models.mmdit import MMDIT_PARAMS, mmdit_modules
from preheat.models.scaled_fp8 import with_scales
from preheat.models.safetensors_files import DIFFUSERS_STEM, TRANSFORMERS_STEM, read_tensors, weight_files

__all__ = ["LAYOUTS", "detect_layout", "held_components", "materialize", "reading_converted", "single_file_path"]


class Rule(NamedTuple):
    """Tensors whose original name starts with ``source`` go to ``component`` as ``target`` + rest."""

    source: str
    component: str
    target: str


# Leaf renames inside one block, original -> diffusers (the rest of the name is kept).
_UNET_RESNET = (("in_layers.0.", "norm1."), ("in_layers.2.", "conv1."), ("emb_layers.1.", "time_emb_proj."),
                ("out_layers.0.", "norm2."), ("out_layers.3.", "conv2."), ("skip_connection.", "conv_shortcut."))
_VAE_RESNET = (("nin_shortcut.", "conv_shortcut."),)
_VAE_ATTENTION = (("norm.", "group_norm."), ("q.", "to_q."), ("k.", "to_k."), ("v.", "to_v."),
                  ("proj_out.", "to_out.0."))


def _unet_rules(cfg: dict[str, Any]) -> list[tuple[str, str, tuple[tuple[str, str], ...]]]:
    """(original prefix, diffusers prefix, leaf renames) for every block of an LDM UNet."""
    layers = int(cfg.get("layers_per_block", 2))
    down = list(cfg["down_block_types"])
    up = list(cfg["up_block_types"])
    out: list[tuple[str, str, tuple[tuple[str, str], ...]]] = [
        ("time_embed.0.", "time_embedding.linear_1.", ()), ("time_embed.2.", "time_embedding.linear_2.", ()),
        ("input_blocks.0.0.", "conv_in.", ()), ("out.0.", "conv_norm_out.", ()), ("out.2.", "conv_out.", ()),
        ("middle_block.0.", "mid_block.resnets.0.", _UNET_RESNET), ("middle_block.1.", "mid_block.attentions.0.", ()),
        ("middle_block.2.", "mid_block.resnets.1.", _UNET_RESNET),
    ]
    index = 1
    for b, kind in enumerate(down):
        for j in range(layers):
            out.append((f"input_blocks.{index}.0.", f"down_blocks.{b}.resnets.{j}.", _UNET_RESNET))
            if "CrossAttn" in kind:
                out.append((f"input_blocks.{index}.1.", f"down_blocks.{b}.attentions.{j}.", ()))
            index += 1
        if b < len(down) - 1:
            out.append((f"input_blocks.{index}.0.op.", f"down_blocks.{b}.downsamplers.0.conv.", ()))
            index += 1
    index = 0
    for b, kind in enumerate(up):
        for j in range(layers + 1):
            out.append((f"output_blocks.{index}.0.", f"up_blocks.{b}.resnets.{j}.", _UNET_RESNET))
            place = 1
            if "CrossAttn" in kind:
                out.append((f"output_blocks.{index}.1.", f"up_blocks.{b}.attentions.{j}.", ()))
                place = 2
            if j == layers and b < len(up) - 1:
                out.append((f"output_blocks.{index}.{place}.conv.", f"up_blocks.{b}.upsamplers.0.conv.", ()))
            index += 1
    return out


def _vae_rules(cfg: dict[str, Any]) -> list[tuple[str, str, tuple[tuple[str, str], ...]]]:
    """The same for an LDM autoencoder (its decoder lists its levels bottom-up, diffusers top-down)."""
    n = len(cfg.get("block_out_channels", (128, 256, 512, 512)))
    layers = int(cfg.get("layers_per_block", 2))
    out: list[tuple[str, str, tuple[tuple[str, str], ...]]] = []
    for part in ("encoder", "decoder"):
        out += [(f"{part}.conv_in.", f"{part}.conv_in.", ()), (f"{part}.conv_out.", f"{part}.conv_out.", ()),
                (f"{part}.norm_out.", f"{part}.conv_norm_out.", ()),
                (f"{part}.mid.block_1.", f"{part}.mid_block.resnets.0.", _VAE_RESNET),
                (f"{part}.mid.attn_1.", f"{part}.mid_block.attentions.0.", _VAE_ATTENTION),
                (f"{part}.mid.block_2.", f"{part}.mid_block.resnets.1.", _VAE_RESNET)]
    for i in range(n):
        for j in range(layers):
            out.append((f"encoder.down.{i}.block.{j}.", f"encoder.down_blocks.{i}.resnets.{j}.", _VAE_RESNET))
        if i < n - 1:
            out.append((f"encoder.down.{i}.downsample.conv.", f"encoder.down_blocks.{i}.downsamplers.0.conv.", ()))
        level = n - 1 - i  # diffusers' up block i is the original's level n - 1 - i
        for j in range(layers + 1):
            out.append((f"decoder.up.{level}.block.{j}.", f"decoder.up_blocks.{i}.resnets.{j}.", _VAE_RESNET))
        if i < n - 1:
            out.append((f"decoder.up.{level}.upsample.conv.", f"decoder.up_blocks.{i}.upsamplers.0.conv.", ()))
    out += [("quant_conv.", "quant_conv.", ()), ("post_quant_conv.", "post_quant_conv.", ())]
    return out


def _rules_table(component: str, top: str,
                 rules: list[tuple[str, str, tuple[tuple[str, str], ...]]]) -> dict[str, tuple[str, str]]:
    """Block rules under ``top``: every original prefix (and leaf) -> (component, diffusers name)."""
    table: dict[str, tuple[str, str]] = {}
    for src, dst, leaves in rules:
        table[top + src] = (component, dst)
        table.update({top + src + leaf_src: (component, dst + leaf_dst) for leaf_src, leaf_dst in leaves})
    return table


def _vae_table(cfg: dict[str, Any], top: str) -> dict[str, tuple[str, str]]:
    """An LDM autoencoder under ``top`` (``first_stage_model.``, or a ComfyUI bundle's ``vae.``)."""
    return _rules_table("vae", top, _vae_rules(cfg))


def _ldm_table(configs: dict[str, dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """LDM layout: every original tensor name the configs imply -> (component, diffusers name)."""
    return {**_vae_table(configs["vae"], "first_stage_model."),
            **_rules_table("unet", "model.diffusion_model.", _unet_rules(configs["unet"]))}


class Place(NamedTuple):
    """Where (part of) one original tensor goes: a component, its diffusers name, and the slice or
    reshape that makes the diffusers tensor (None: the tensor as it is)."""

    component: str
    name: str
    take: Callable[[np.ndarray], np.ndarray] | None = None
    rows: int | None = None  # a fused tensor's first axis as the config's widths make it (checked)


# What a layout's ``place`` says about one original tensor: its places, [] for a tensor the
# diffusers folder deliberately does not hold, None for one that fits no block of the configs.
Placer = Callable[[str], "list[Place] | None"]


def _by_prefix(table: dict[str, tuple[str, str]], key: str) -> list[Place] | None:
    """The longest prefix of ``key`` in ``table`` wins (a block's leaf rule over the block itself)."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut]) + "."
        if prefix in table:
            component, target = table[prefix]
            return [Place(component, target + ".".join(parts[cut:]))]
    return None


def _as_linear(t: np.ndarray) -> np.ndarray:
    return t.reshape(t.shape[:2]) if t.ndim == 4 else t  # [O, I, 1, 1] 1x1 convolution -> [O, I]


def _as_conv(t: np.ndarray) -> np.ndarray:
    return t.reshape(*t.shape, 1, 1) if t.ndim == 2 else t  # [O, I] -> [O, I, 1, 1]


def _fit_projections(places: list[Place] | None, linear_unet: bool) -> list[Place] | None:
    """1x1 convolutions and linear layers are one map in two shapes: the VAE's attention is linear
    in diffusers (a convolution in the original), the UNet's transformer ``proj_in``/``proj_out``
    whatever the config's ``use_linear_projection`` says (SD 1.x files: conv; SD 2.x, SDXL: linear)."""
    if not places:
        return places
    component, name = places[0].component, places[0].name
    if component == "vae" and ".attentions." in name and name.endswith(".weight"):
        return [Place(component, name, _as_linear)]
    if component == "unet" and name.endswith((".proj_in.weight", ".proj_out.weight")) and ".attentions." in name:
        return [Place(component, name, _as_linear if linear_unet else _as_conv)]
    return places


def _clip(component: str, rest: str) -> list[Place]:
    """An OpenAI-CLIP text model in transformers' names (``text_model.`` added where the file has none)."""
    return [Place(component, rest if rest.startswith("text_model.") else "text_model." + rest)]


_OPEN_CLIP_LEAVES = {"ln_1.": "layer_norm1.", "ln_2.": "layer_norm2.", "mlp.c_fc.": "mlp.fc1.",
                     "mlp.c_proj.": "mlp.fc2.", "attn.out_proj.": "self_attn.out_proj."}


def _open_clip(component: str, rest: str, runs: int | None = None, projection: bool = True) -> list[Place] | None:
    """An OpenCLIP text tower in transformers' CLIP names: SDXL's bigG (CLIPTextModelWithProjection,
    every block), or SD 2.x's ViT-H as diffusers holds it (CLIPTextModel: ``runs`` blocks, the ones
    before the penultimate output SD 2.x conditions on, and no projection)."""
    fixed = {"token_embedding.weight": "text_model.embeddings.token_embedding.weight",
             "positional_embedding": "text_model.embeddings.position_embedding.weight",
             "ln_final.weight": "text_model.final_layer_norm.weight", "ln_final.bias": "text_model.final_layer_norm.bias"}
    if rest in fixed:
        return [Place(component, fixed[rest])]
    if rest == "text_projection":  # [D, P] applied as x @ W; transformers' Linear holds [P, D]
        return [Place(component, "text_projection.weight", lambda t: t.T)] if projection else []
    block, sep, leaf = rest.partition(".")
    if block != "transformer" or not leaf.startswith("resblocks."):
        return None
    _, i, leaf = leaf.split(".", 2)
    if runs is not None and int(i) >= runs:
        return []  # past the layer the pipeline reads (SD 2.x: the last block)
    layer = f"text_model.encoder.layers.{i}."
    if leaf in ("attn.in_proj_weight", "attn.in_proj_bias"):  # q, k, v stacked on the first axis
        kind = leaf.rsplit("_", 1)[1]
        return [Place(component, f"{layer}self_attn.{n}_proj.{kind}",
                      lambda t, j=j: t[j * (t.shape[0] // 3):(j + 1) * (t.shape[0] // 3)])
                for j, n in enumerate("qkv")]
    for src, dst in _OPEN_CLIP_LEAVES.items():
        if leaf.startswith(src):
            return [Place(component, layer + dst + leaf[len(src):])]
    return None


def _ldm_placer(configs: dict[str, dict[str, Any]]) -> Placer:
    """LDM (SD 1.x, SD 2.x): the UNet and VAE by the configs' block table, the text encoder by its kind."""
    table = _ldm_table(configs)
    linear = bool(configs["unet"].get("use_linear_projection", False))
    runs = int(configs["text_encoder"]["num_hidden_layers"])

    def place(key: str) -> list[Place] | None:
        if key.startswith("cond_stage_model.transformer."):
            return _clip("text_encoder", key[len("cond_stage_model.transformer."):])
        if key.startswith("cond_stage_model.model."):
            return _open_clip("text_encoder", key[len("cond_stage_model.model."):], runs=runs, projection=False)
        return _fit_projections(_by_prefix(table, key), linear)

    return place


# a text embedder's renaming into transformers' names: (component, the name past its prefix) -> places
Rename = Callable[[str, str], "list[Place] | None"]


def _sgm_embedders(configs: dict[str, dict[str, Any]], embedders: dict[str, tuple[str, Rename]]) -> Placer:
    """SGM: the LDM UNet and VAE plus the size/pooled-text embedding (``label_emb``), and each text
    embedder (``conditioner.embedders.N.<kind>.`` -> (component, the CLIP or OpenCLIP renaming))."""
    table = _ldm_table(configs)
    table["model.diffusion_model.label_emb.0.0."] = ("unet", "add_embedding.linear_1.")
    table["model.diffusion_model.label_emb.0.2."] = ("unet", "add_embedding.linear_2.")
    linear = bool(configs["unet"].get("use_linear_projection", False))

    def place(key: str) -> list[Place] | None:
        top = next((t for t in embedders if key.startswith(t)), None)
        if top is not None:
            component, rename = embedders[top]
            return rename(component, key[len(top):])
        return _fit_projections(_by_prefix(table, key), linear)

    return place


def _sgm_placer(configs: dict[str, dict[str, Any]]) -> Placer:
    """SGM (SDXL base): embedder 0 is CLIP-L, embedder 1 OpenCLIP bigG."""
    return _sgm_embedders(configs, {"conditioner.embedders.0.transformer.": ("text_encoder", _clip),
                                    "conditioner.embedders.1.model.": ("text_encoder_2", _open_clip)})


def _sgm_refiner_placer(configs: dict[str, dict[str, Any]]) -> Placer:
    """SGM (SDXL refiner): OpenCLIP bigG is embedder 0, and the only one; diffusers' refiner folder
    holds it as ``text_encoder_2`` (its ``text_encoder`` is [null, null])."""
    return _sgm_embedders(configs, {"conditioner.embedders.0.model.": ("text_encoder_2", _open_clip)})


def _cut(piece: Piece) -> Callable[[np.ndarray], np.ndarray] | None:
    """An original tensor -> the piece diffusers holds: a row range, or the two halves swapped."""
    if piece.swap:
        return lambda t: np.concatenate([t[t.shape[0] // 2:], t[:t.shape[0] // 2]])
    if piece.start is None:
        return None
    return lambda t: t[piece.start:piece.stop]


def _pieces(modules: dict[str, tuple[Piece, ...]], key: str, params: dict[str, str] | None = None) -> list[Place] | None:
    """A transformer tensor by a module table (``bfl_modules``, ``mmdit_modules``): its module's
    pieces with the leaf kept (a norm's ``scale`` is diffusers' ``weight``), or a bare parameter."""
    if params and key in params:
        return [Place("transformer", params[key])]
    module, _, leaf = key.rpartition(".")
    pieces = modules.get(module)
    if pieces is None:
        return None
    leaf = "weight" if leaf == "scale" else leaf  # BFL's RMSNorm scale is diffusers' weight
    rows = pieces[-1].stop if len(pieces) > 1 else None
    return [Place("transformer", f"{p.path}.{leaf}", _cut(p), rows) for p in pieces]


# ComfyUI's bundles: text encoders in transformers' names under text_encoders.<name>.transformer.,
# the VAE in the LDM layout under first_stage_model. or vae.
_VAE_TOPS = ("first_stage_model.", "vae.")
_TEXT_ENCODERS = {"mmdit": {"clip_l": "text_encoder", "clip_g": "text_encoder_2", "t5xxl": "text_encoder_3"},
                  "bfl": {"clip_l": "text_encoder", "t5xxl": "text_encoder_2"}}


def _bundled(configs: dict[str, dict[str, Any]], encoders: dict[str, str], clip_l_projection: bool) -> Placer:
    """A bundle's VAE and text encoder tensors (None: neither). SD3 pools CLIP-L's output unprojected
    (as in diffusers, its ``text_projection`` is the identity, whatever the file holds); FLUX.1's
    CLIP-L has no projection."""
    vae = {top: _vae_table(configs["vae"], top) for top in _VAE_TOPS} if "vae" in configs else {}

    def place(key: str) -> list[Place] | None:
        top = next((t for t in vae if key.startswith(t)), None)
        if top is not None:
            return _fit_projections(_by_prefix(vae[top], key), False)
        name, _, rest = key.removeprefix("text_encoders.").partition(".transformer.")
        if not key.startswith("text_encoders.") or name not in encoders:
            return None
        component = encoders[name]
        if name == "t5xxl":
            return [Place(component, rest)]
        if rest.startswith("text_projection."):
            return [] if name == "clip_l" else [Place(component, rest)]
        places = _clip(component, rest)
        if name == "clip_l" and clip_l_projection and rest.endswith("final_layer_norm.weight"):
            places.append(Place(component, "text_projection.weight", lambda t: np.eye(t.shape[0], dtype=t.dtype)))
        return places

    return place


def _bfl_placer(configs: dict[str, dict[str, Any]]) -> Placer:
    """BFL (FLUX.1's transformer): the shared BFL table for the config's blocks and widths; a
    ComfyUI bundle's VAE and text encoders (CLIP-L, T5) besides."""
    cfg = configs["transformer"]
    modules = bfl_modules(range(int(cfg["num_layers"])), range(int(cfg["num_single_layers"])),
                          flux_widths(int(cfg["num_attention_heads"]), int(cfg["attention_head_dim"])))
    bundled = _bundled(configs, _TEXT_ENCODERS["bfl"], clip_l_projection=False)

    def place(key: str) -> list[Place] | None:
        found = bundled(key)
        return found if found is not None else _pieces(modules, key.removeprefix("model.diffusion_model."))

    return place


def _mmdit_placer(configs: dict[str, dict[str, Any]]) -> Placer:
    """SD3 / SD3.5 (MMDiT): the transformer by ``mmdit_modules`` for the config's blocks, norms and
    dual-attention blocks; a bundle's VAE and text encoders (CLIP-L, CLIP-G, T5) besides."""
    modules = mmdit_modules(configs["transformer"])
    bundled = _bundled(configs, _TEXT_ENCODERS["mmdit"], clip_l_projection=True)

    def place(key: str) -> list[Place] | None:
        found = bundled(key)
        return found if found is not None else _pieces(modules, key.removeprefix("model.diffusion_model."),
                                                        MMDIT_PARAMS)

    return place


class Layout(NamedTuple):
    """One original layout: how to recognise it, the diffusers folders it fills, and its placer."""

    name: str
    markers: tuple[str, ...]  # key prefixes only this layout's files have
    components: tuple[str, ...]  # the diffusers folders whose configs build the placer
    placer: Callable[[dict[str, dict[str, Any]]], Placer]
    optional: tuple[str, ...] = ()  # configs read where the folder has them (a bundle's VAE)


# most specific first: SGM, SD3 and prefixed BFL files hold model.diffusion_model.* keys too, and a
# refiner's conditioner.embedders.0.model.* (OpenCLIP where the base has CLIP-L) are conditioner.embedders.*
LAYOUTS: tuple[Layout, ...] = (
    Layout("sgm-refiner", ("conditioner.embedders.0.model.",), ("unet", "vae", "text_encoder_2"), _sgm_refiner_placer),
    Layout("sgm", ("conditioner.embedders.",), ("unet", "vae", "text_encoder", "text_encoder_2"), _sgm_placer),
    Layout("mmdit", ("joint_blocks.", "model.diffusion_model.joint_blocks."), ("transformer",), _mmdit_placer, ("vae",)),
    Layout("bfl", ("double_blocks.", "model.diffusion_model.double_blocks."), ("transformer",), _bfl_placer, ("vae",)),
    Layout("ldm", ("model.diffusion_model.",), ("unet", "vae", "text_encoder"), _ldm_placer),
)
# tensors of the original files that diffusers' folders do not hold (EMA copies, buffers)
_DROPPED = ("model_ema.", "cond_stage_model.transformer.text_model.embeddings.position_ids",
            "cond_stage_model.transformer.embeddings.position_ids", "cond_stage_model.model.logit_scale",
            "conditioner.embedders.0.transformer.text_model.embeddings.position_ids", "conditioner.embedders.1.model.logit_scale",
            "conditioner.embedders.0.model.logit_scale",  # the refiner's OpenCLIP
            "alphas_cumprod", "betas", "posterior_", "sqrt_", "log_one_minus", "logvar",
            *(f"text_encoders.{name}.logit_scale" for name in ("clip_l", "clip_g", "t5xxl")),
            *(f"text_encoders.{name}.transformer.text_model.embeddings.position_ids" for name in ("clip_l", "clip_g")))


def detect_layout(keys: list[str], path: Path) -> Layout:
    """The layout whose marker the file's keys carry; a one-line ModelFormatError otherwise."""
    for layout in LAYOUTS:
        if any(k.startswith(layout.markers) for k in keys):
            return layout
    seen = ", ".join(sorted(keys)[:4]) or "no tensors"
    tried = ", ".join(f"{lay.name} ({', '.join(m + '*' for m in lay.markers)})" for lay in LAYOUTS)
    raise ModelFormatError(f"{path} is a single file of unknown layout: tried {tried}; its keys start {seen}")


def held_components(keys: list[str], layout: Layout) -> tuple[str, ...]:
    """The diffusers components a file of ``layout`` holds weights for, by its keys' prefixes (no
    config needed): an LDM or SGM checkpoint all of them; a transformer file its transformer, plus
    what a ComfyUI bundle adds (the VAE, the text encoders)."""
    encoders = _TEXT_ENCODERS.get(layout.name)
    if encoders is None:
        return layout.components
    held = ["transformer"] + (["vae"] if any(k.startswith(_VAE_TOPS) for k in keys) else [])
    held += [c for name, c in encoders.items() if any(k.startswith(f"text_encoders.{name}.transformer.") for k in keys)]
    return tuple(held)


def _read_config(folder: Path, component: str, layout: Layout) -> dict[str, Any]:
    path = folder / component / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"config folder {folder} has no {component}/config.json, which a file of the "
                                 f"{layout.name} layout needs (its placer reads {', '.join(layout.components)})")
    return json.loads(path.read_text())


_WEIGHTS = (".safetensors", ".bin", ".ckpt")  # a config folder's weight files (its configs are the rest)


def _where(path: Path) -> bytes:
    """A file by where it is (resolved path, size, mtime): what names it without reading it."""
    st = path.stat()
    return f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()


def _identity(file: Path, config: Path, variant: str | None) -> str:
    """What the converted folder is named by: the file and the config folder's weights by where
    they are (the converted folder links the weights of the components the file lacks, so other
    weights are another folder), the config folder's other files by their content, and the
    variant whose weights of those components it links."""
    h = hashlib.sha256(_where(file) + f"\0variant={variant or ''}".encode())
    for p in _config_files(config):
        body = _where(p) if p.name.endswith(_WEIGHTS) else p.read_bytes()
        h.update(p.relative_to(config).as_posix().encode() + b"\0" + body)
    return h.hexdigest()[:32]


def _config_files(config: Path) -> list[Path]:
    """Every file of the config folder, in the order ``_identity`` reads them: what the converted
    folder is named by, so what it records as made from (``write_made_from``: the weights by where
    they are, the rest by content), and an edited config JSON makes it stale."""
    return [p for p in sorted(config.rglob("*")) if p.is_file()]


def _is_weights(name: str) -> bool:
    return name.endswith(_WEIGHTS) or name.endswith(".index.json")


def _variant_weights(folder: Path, variant: str | None) -> list[tuple[Path, str]]:
    """One component's weights in ``variant`` (None: the default ones) -> the names a folder without
    variants gives them: ``<stem>.<variant>.safetensors`` as ``<stem>.safetensors``; a sharded
    variant's index as ``<stem>.safetensors.index.json`` (its shards keep the names it lists).
    None found: ``weight_files``' one line, naming what was looked for."""
    for stem in (DIFFUSERS_STEM, TRANSFORMERS_STEM):
        base = f"{stem}.{variant}" if variant else stem
        one = folder / f"{base}.safetensors"
        if one.is_file():
            return [(one, f"{stem}.safetensors")]
        indexes = [folder / f"{stem}.safetensors.index.{variant}.json"] if variant else []
        index = next((i for i in [*indexes, folder / f"{base}.safetensors.index.json"] if i.is_file()), None)
        if index is not None:
            shards = weight_files(folder, (stem,), variant)  # every shard it lists is there
            return [(index, f"{stem}.safetensors.index.json"), *((s, s.name) for s in shards)]
    weight_files(folder, variant=variant)  # raises: nothing of that variant
    return []


def _taken(config: Path, held: set[str], variant: str | None, file: Path) -> list[tuple[Path, str]]:
    """The weights the converted folder takes from ``config``: for each component folder with
    weights that the file does not fill, those of ``variant`` (``_variant_weights``), as
    (source, path in the converted folder). A component ``model_index.json`` names (the safety
    checker aside: never read) without them is one line; other folders' weights are left out."""
    index = json.loads((config / "model_index.json").read_text())
    used = {k for k, v in index.items() if isinstance(v, list) and None not in v and k != "safety_checker"}
    folders = sorted({p.parent for p in config.glob("*/*") if p.is_file() and _is_weights(p.name)})
    out: list[tuple[Path, str]] = []
    for folder in folders:
        if folder.name in held:
            continue
        try:
            out += [(src, f"{folder.name}/{name}") for src, name in _variant_weights(folder, variant)]
        except (ModelNotFoundError, ModelFormatError) as exc:
            if folder.name in used:
                what = f"{variant!r} weights" if variant else "weights without a variant"
                raise ModelNotFoundError(f"single file {file} lacks {folder.name}/, whose {what} config "
                                         f"{config} does not have: {exc}") from None
    return out


_SINGLE = (".safetensors", ".gguf")  # what a single checkpoint file is named (a GGUF: a FLUX.1 transformer)


def single_file_path(path: str | os.PathLike[str]) -> Path | None:
    """``path`` as a single-file checkpoint: a ``.safetensors`` or ``.gguf`` file, or the file of a
    one-file snapshot of the weights store (``hf://org/repo/file.safetensors`` or ``.gguf``, a
    URL: a folder holding that file and no config); None for anything else (a diffusers folder)."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() in _SINGLE else None
    if not path.is_dir() or (path / "model_index.json").exists() or (path / "config.json").exists():
        return None
    inside = [p for p in path.rglob("*") if p.is_file()]  # hf://org/repo/sub/file keeps its path
    return inside[0] if len(inside) == 1 and inside[0].suffix.lower() in _SINGLE else None


def materialize(file: str | os.PathLike[str], config: str | os.PathLike[str], root: Path,
                variant: str | None = None) -> Path:
    """The diffusers folder for single ``file`` under ``config``'s configs (converted once, under ``root``).

    ``variant`` (``"fp16"``) picks the config folder's weights of the components the file lacks
    (a FLUX.1 transformer file's VAE and text encoders), as diffusers' ``from_single_file`` does:
    the file's own weights are what it holds. The folder has no variants (its files have the
    default names), so it is read with ``variant=None``."""
    from safetensors.numpy import save_file

    file, config = Path(file), Path(config)
    if file.is_dir():  # a one-file snapshot of the weights store (hf://org/repo/file.safetensors, a URL)
        inside = sorted(p for p in file.rglob("*") if p.suffix.lower() in _SINGLE and p.is_file())
        if len(inside) != 1:
            raise InvalidArgumentError(f"{file} holds {len(inside)} .safetensors / .gguf files; a single-file "
                                       "checkpoint with config= must be one file", argument="model")
        file = inside[0]
    if not file.is_file():
        raise ModelNotFoundError(f"single file {file} does not exist")
    if not (config / "model_index.json").is_file():
        raise InvalidArgumentError(f"config={str(config)!r} must be a diffusers folder with model_index.json",
                                   argument="config")
    out = root / "models" / "single" / _identity(file, config, variant)
    if (out / "model_index.json").is_file():
        return out
    reader = GGUFTensors(file) if is_gguf(file) else read_tensors([file])  # GGUF: Q8_0 values + scales, blocks
    with reader as f:  # headers checked (a torn file is one line); F8_E4M3 through ml_dtypes
        keys = list(f)
        layout = detect_layout(keys, file)
        configs = {c: _read_config(config, c, layout) for c in layout.components}
        configs.update({c: _read_config(config, c, layout) for c in layout.optional
                        if (config / c / "config.json").is_file()})
        try:
            place = with_scales(layout.placer(configs))
        except KeyError as exc:  # a config of another kind of model (the placers read its block structure)
            where = next((f"{c}/config.json" for c, cfg in configs.items() if exc.args[0] not in cfg), "a config")
            raise CheckpointMismatchError(f"the configs of {config} do not fit a file of the {layout.name} layout "
                                          f"({where} has no {exc.args[0]!r})") from None
        parts: dict[str, dict[str, np.ndarray]] = {}  # the components the file fills
        unplaced = []
        for key in keys:
            if key.startswith(_DROPPED):
                continue
            places = place(key)
            if places is None:
                unplaced.append(key)
                continue
            tensor = f[key] if places else None
            for component, name, take, rows in places:
                if rows is not None and tensor.shape[0] != rows:
                    raise CheckpointMismatchError(f"{file} ({layout.name} layout): {key} has {tensor.shape[0]} rows; the blocks "
                                       f"of {config}'s {component} config make {rows}")
                t = tensor if take is None else take(tensor)
                parts.setdefault(component, {})[name] = np.ascontiguousarray(t)
    if unplaced:
        raise CheckpointMismatchError(f"{file} ({layout.name} layout) has {len(unplaced)} tensors that do not fit the blocks of "
                           f"{config}'s configs, e.g. {', '.join(unplaced[:3])}")
    taken = _taken(config, set(parts), variant, file)  # checked before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        for p in sorted(config.rglob("*")):
            if p.is_file() and not _is_weights(p.name) and p.name != MADE_FROM:  # configs and tokenizer files
                dst = tmp / p.relative_to(config)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, dst)
        for src, rel in taken:  # the components the file does not hold (Flux: the VAE, the text encoders)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).symlink_to(src.resolve())
        for component, tensors in parts.items():
            stem = "model" if component.startswith("text_encoder") else "diffusion_pytorch_model"
            (tmp / component).mkdir(exist_ok=True)
            save_file(tensors, str(tmp / component / f"{stem}.safetensors"))
        configs = _config_files(config)  # named by them, so stale once one changes (the store's gc collects it)
        write_made_from(tmp, [file, *(src for src, _ in taken)],  # a deleted config or weights file of the
                        contents=[p for p in configs if not p.name.endswith(_WEIGHTS)],  # folder still there: stale
                        config_weights=[p for p in configs if p.name.endswith(_WEIGHTS)])
        publish_folder(tmp, out)  # another process may have converted it first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@contextmanager
def reading_converted(file: Any, config: Any, converted: Path) -> Iterator[None]:
    """Around loading a converted folder: tensors that do not fit the config's model (a shape, a
    missing or extra tensor: the loader's ``WeightsError``) are the single file's fault, so the
    one-line error names it, and the conversion is not kept."""
    try:
        yield
    except WeightsError as exc:
        shutil.rmtree(converted, ignore_errors=True)
        raise CheckpointMismatchError(f"single file {file} does not fit the configs of {config}: {exc}") from None
