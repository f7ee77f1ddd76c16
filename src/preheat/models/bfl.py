"""Flux's original (Black Forest Labs) module names -> diffusers' ``FluxTransformer2DModel`` layers.

One table for everything that reads BFL names: single-file checkpoints (``double_blocks.0.img_attn.qkv.weight``,
``preheat.models.single_file``) and LoRA files (kohya's ``lora_unet_double_blocks_0_img_attn_qkv``,
``families.flux.bfl_lora_names``). BFL fuses layers that diffusers keeps apart, so one BFL module
can feed several diffusers layers, each a row range of it:

* a double block's ``img_attn.qkv`` / ``txt_attn.qkv``: q, k, v (``to_q/k/v``, ``add_q/k/v_proj``);
* a single block's ``linear1``: q, k, v and the MLP's input (``proj_mlp``);
* ``final_layer.adaLN_modulation.1``: BFL's halves are (shift, scale), diffusers' ``norm_out.linear``
  (scale, shift), so its rows swap halves.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

__all__ = ["Piece", "bfl_modules", "flux_widths"]


class Piece(NamedTuple):
    """A diffusers layer fed by (a row range of) one BFL module's output rows."""

    path: str  # diffusers module path, e.g. "transformer_blocks.0.attn.to_q"
    start: int | None = None  # first row of the BFL tensor (None: all of it)
    stop: int | None = None  # end row
    swap: bool = False  # swap the two halves of the rows: BFL's (shift, scale) -> diffusers' (scale, shift)


# the rest of the blocks' one-to-one modules: BFL suffix -> diffusers suffix
_DOUBLE = (("img_attn.proj", "attn.to_out.0"), ("img_mlp.0", "ff.net.0.proj"), ("img_mlp.2", "ff.net.2"),
           ("img_mod.lin", "norm1.linear"), ("txt_attn.proj", "attn.to_add_out"),
           ("txt_mlp.0", "ff_context.net.0.proj"), ("txt_mlp.2", "ff_context.net.2"),
           ("txt_mod.lin", "norm1_context.linear"),
           # RMSNorms of q and k (BFL's leaf "scale" is diffusers' "weight")
           ("img_attn.norm.query_norm", "attn.norm_q"), ("img_attn.norm.key_norm", "attn.norm_k"),
           ("txt_attn.norm.query_norm", "attn.norm_added_q"), ("txt_attn.norm.key_norm", "attn.norm_added_k"))
_SINGLE = (("linear2", "proj_out"), ("modulation.lin", "norm.linear"), ("norm.query_norm", "attn.norm_q"),
           ("norm.key_norm", "attn.norm_k"))
_TOP = (("img_in", "x_embedder"), ("txt_in", "context_embedder"),
        ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
        ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
        ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
        ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
        ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
        ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
        ("final_layer.linear", "proj_out"))


def bfl_modules(doubles: Iterable[int], singles: Iterable[int],
                width: Callable[[str], int]) -> dict[str, tuple[Piece, ...]]:
    """BFL module name (dots, no leaf) -> the diffusers layers it feeds, for the given double and
    single block indices. ``width(path)``: a diffusers layer's output rows (to cut fused modules)."""
    def fused(*paths: str) -> tuple[Piece, ...]:
        out, row = [], 0
        for path in paths:
            out.append(Piece(path, row, row + width(path)))
            row += width(path)
        return tuple(out)

    names: dict[str, tuple[Piece, ...]] = {}
    for i in doubles:
        d = f"transformer_blocks.{i}"
        names[f"double_blocks.{i}.img_attn.qkv"] = fused(f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v")
        names[f"double_blocks.{i}.txt_attn.qkv"] = fused(f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj",
                                                         f"{d}.attn.add_v_proj")
        names.update({f"double_blocks.{i}.{bfl}": (Piece(f"{d}.{path}"),) for bfl, path in _DOUBLE})
    for i in singles:
        s = f"single_transformer_blocks.{i}"
        names[f"single_blocks.{i}.linear1"] = fused(f"{s}.attn.to_q", f"{s}.attn.to_k", f"{s}.attn.to_v",
                                                    f"{s}.proj_mlp")
        names.update({f"single_blocks.{i}.{bfl}": (Piece(f"{s}.{path}"),) for bfl, path in _SINGLE})
    names.update({bfl: (Piece(path),) for bfl, path in _TOP})
    names["final_layer.adaLN_modulation.1"] = (Piece("norm_out.linear", swap=True),)
    return names


def flux_widths(num_attention_heads: int, attention_head_dim: int, mlp_ratio: float = 4.0) -> Callable[[str], int]:
    """``width`` for ``bfl_modules`` from a transformer config: attention projections are
    heads x head_dim rows, a single block's ``proj_mlp`` ``mlp_ratio`` times that (diffusers' 4.0)."""
    inner = num_attention_heads * attention_head_dim
    return lambda path: int(inner * mlp_ratio) if path.endswith("proj_mlp") else inner
