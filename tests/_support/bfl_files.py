"""A diffusers ``FluxTransformer2DModel``'s weights written back in Black Forest Labs' original names
(the layout of ``flux1-dev.safetensors``), by hand from BFL's module structure, so that the tests'
inverse is independent of preheat's table (``preheat.models.bfl``)::

    to_bfl(state, prefix="")  -> {BFL name: tensor}     (prefix "model.diffusion_model." for ComfyUI's)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

# diffusers module -> BFL module, one to one (the fused q/k/v and linear1 are concatenated below)
_TOP = {"x_embedder": "img_in", "context_embedder": "txt_in",
        "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "proj_out": "final_layer.linear"}
_DOUBLE = {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0",
           "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
           "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
           "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
           "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm"}
_SINGLE = {"proj_out": "linear2", "norm.linear": "modulation.lin", "attn.norm_q": "norm.query_norm",
           "attn.norm_k": "norm.key_norm"}
# fused BFL module -> the diffusers modules stacked in it, in order
_FUSED_DOUBLE = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_FUSED_SINGLE = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}


def to_bfl(state: dict[str, np.ndarray], prefix: str = "") -> dict[str, np.ndarray]:
    """``state`` (diffusers' names) in BFL's: q/k/v (and a single block's MLP input) stacked on the
    first axis, RMSNorm ``weight`` as ``scale``, the final modulation's (scale, shift) as BFL's (shift, scale)."""
    out: dict[str, np.ndarray] = {}

    def put(bfl: str, leaf: str, value: np.ndarray) -> None:
        out[f"{prefix}{bfl}.{'scale' if bfl.endswith('_norm') else leaf}"] = value

    blocks: dict[tuple[str, str], dict[str, np.ndarray]] = {}  # (BFL block, leaf) -> diffusers module -> tensor
    for key, value in state.items():
        module, leaf = key.rsplit(".", 1)
        if m := re.match(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.*)", module):
            kind, i, inner = m[1], m[2], m[3]
            bfl_block = f"{'double' if kind == 'transformer_blocks' else 'single'}_blocks.{i}"
            one = _DOUBLE if kind == "transformer_blocks" else _SINGLE
            if inner in one:
                put(f"{bfl_block}.{one[inner]}", leaf, value)
            else:
                blocks.setdefault((bfl_block, leaf), {})[inner] = value
        elif module == "norm_out.linear":  # diffusers' halves are (scale, shift); BFL's (shift, scale)
            scale, shift = np.split(value, 2)
            put("final_layer.adaLN_modulation.1", leaf, np.concatenate([shift, scale]))
        else:
            put(_TOP[module], leaf, value)
    for (bfl_block, leaf), parts in blocks.items():
        fused = _FUSED_DOUBLE if bfl_block.startswith("double") else _FUSED_SINGLE
        for bfl, order in fused.items():
            put(f"{bfl_block}.{bfl}", leaf, np.concatenate([parts.pop(name) for name in order]))
        assert not parts, f"unexpected Flux tensors in {bfl_block}: {sorted(parts)}"
    return out


def transformer_config_folder(folder: Path, model: Any) -> Path:
    """``folder`` as the config folder a FLUX.1 transformer file is paired with (``config=``): a
    model index naming the transformer and ``transformer/config.json`` of diffusers' ``model``."""
    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                         "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    (folder / "transformer" / "config.json").write_text(json.dumps({**dict(model.config),
                                                                    "_class_name": "FluxTransformer2DModel"}))
    return folder
