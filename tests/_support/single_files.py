"""Single files in the original layouts, written from a diffusers folder by inverting preheat's own
tables (``preheat.models.mmdit``, ``preheat.models.bfl``, the LDM VAE table and the bundles'
text-encoder names in ``preheat.models.single_file``); diffusers' ``from_single_file`` reading the
result is what checks them::

    mmdit_file(folder)                       -> {original name: tensor}  (SD3 / SD3.5 MMDiT)
    bfl_file(folder)                         -> the same for FLUX.1's transformer
    bundle(folder, layout, vae_top=...)      -> a ComfyUI bundle: VAE + text encoders as well
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from preheat.models.bfl import Piece, bfl_modules, flux_widths
from preheat.models.mmdit import MMDIT_PARAMS, mmdit_modules
from preheat.models.single_file import _TEXT_ENCODERS, _vae_table


def _load(folder: Path, component: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    stem = "model" if component.startswith("text_encoder") else "diffusion_pytorch_model"
    return load_file(str(folder / component / f"{stem}.safetensors"))


def _config(folder: Path, component: str) -> dict:
    return json.loads((folder / component / "config.json").read_text())


def invert_modules(state: dict[str, np.ndarray], modules: dict[str, tuple[Piece, ...]],
                   params: dict[str, str] | None = None, norm_leaf: str = "weight") -> dict[str, np.ndarray]:
    """A transformer's diffusers tensors under the original names of a module table: the pieces of
    one original module stacked in the table's order, swapped halves swapped back."""
    where = {p.path: (orig, j) for orig, pieces in modules.items() for j, p in enumerate(pieces)}
    bare = {dst: src for src, dst in (params or {}).items()}
    fused: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    out: dict[str, np.ndarray] = {}
    for key, value in state.items():
        if key in bare:
            out[bare[key]] = value
            continue
        path, leaf = key.rsplit(".", 1)
        orig, j = where[path]  # a KeyError: a diffusers tensor the table cannot place
        fused.setdefault((orig, leaf), {})[j] = value
    for (orig, leaf), parts in fused.items():
        pieces = modules[orig]
        assert sorted(parts) == list(range(len(pieces))), (orig, leaf, sorted(parts))
        value = np.concatenate([parts[j] for j in range(len(pieces))])
        if pieces[0].swap:
            value = np.concatenate([value[value.shape[0] // 2:], value[:value.shape[0] // 2]])
        out[f"{orig}.{norm_leaf if orig.endswith('_norm') else leaf}"] = value
    return out


def mmdit_file(folder: Path, prefix: str = "model.diffusion_model.") -> dict[str, np.ndarray]:
    """The folder's SD3 transformer in Stability's MMDiT names."""
    tensors = invert_modules(_load(folder, "transformer"), mmdit_modules(_config(folder, "transformer")), MMDIT_PARAMS)
    return {prefix + k: v for k, v in tensors.items()}


def bfl_file(folder: Path, prefix: str = "model.diffusion_model.") -> dict[str, np.ndarray]:
    """The folder's FLUX.1 transformer in BFL's names (RMSNorm weights as ``scale``)."""
    cfg = _config(folder, "transformer")
    modules = bfl_modules(range(cfg["num_layers"]), range(cfg["num_single_layers"]),
                          flux_widths(cfg["num_attention_heads"], cfg["attention_head_dim"]))
    return {prefix + k: v for k, v in invert_modules(_load(folder, "transformer"), modules, norm_leaf="scale").items()}


def vae_file(folder: Path, top: str) -> dict[str, np.ndarray]:
    """The folder's VAE in the LDM layout under ``top`` (attention projections as 1x1 convolutions)."""
    table = {dst: src for src, (_, dst) in _vae_table(_config(folder, "vae"), top).items()}
    out = {}
    for key, value in _load(folder, "vae").items():
        cut = max((d for d in table if key.startswith(d)), key=len)  # the leaf rule over its block's
        if ".attentions." in key and key.endswith(".weight") and value.ndim == 2:
            value = value[:, :, None, None]
        out[table[cut] + key[len(cut):]] = value
    return out


def text_file(folder: Path, layout: str) -> dict[str, np.ndarray]:
    """The folder's text encoders under ``text_encoders.<name>.transformer.`` (CLIP with its
    ``text_model.`` prefix, as transformers 4 saved it and ComfyUI's files hold it)."""
    out = {}
    for name, component in _TEXT_ENCODERS[layout].items():
        for key, value in _load(folder, component).items():
            if name != "t5xxl" and not key.startswith(("text_model.", "text_projection.")):
                key = "text_model." + key
            out[f"text_encoders.{name}.transformer.{key}"] = value
        if name == "t5xxl":  # the tied embedding under both names, as transformers 4 saved T5 (diffusers'
            out[f"text_encoders.{name}.transformer.encoder.embed_tokens.weight"] = out[  # loader does not re-tie)
                f"text_encoders.{name}.transformer.shared.weight"]
        out[f"text_encoders.{name}.logit_scale"] = np.array(4.6052, np.float32)  # ComfyUI's wrapper's; unused
    return out


def bundle(folder: Path, layout: str, vae_top: str = "first_stage_model.") -> dict[str, np.ndarray]:
    """A ComfyUI checkpoint: the transformer under ``model.diffusion_model.``, the VAE under
    ``vae_top``, the text encoders under ``text_encoders.``."""
    transformer = mmdit_file(folder) if layout == "mmdit" else bfl_file(folder)
    return {**transformer, **vae_file(folder, vae_top), **text_file(folder, layout)}


@contextmanager
def diffusers_bfl_at_tiny_widths(folder: Path, monkeypatch: Any) -> Iterator[None]:
    """diffusers' BFL conversion (``from_single_file`` of a FLUX.1 file) cuts a single block's
    ``linear1`` at FLUX.1's widths (``inner_dim = 3072`` is written into it), which a tiny model's
    rows cannot take; inside this block ``torch.split`` gets the tiny widths for that one cut (q, k,
    v: heads x head_dim, the MLP 4x that), and everything else is diffusers' own."""
    import torch

    cfg = _config(folder, "transformer")
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    split = torch.split

    def tiny_split(tensor: Any, sizes: Any, dim: int = 0) -> Any:
        if isinstance(sizes, (list, tuple)) and tuple(sizes) == (3072, 3072, 3072, 12288):
            sizes = (inner, inner, inner, 4 * inner)
        return split(tensor, sizes, dim)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "split", tiny_split)
        yield
