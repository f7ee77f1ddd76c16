"""SD3's original (Stability AI's MMDiT) module names -> diffusers' ``SD3Transformer2DModel`` layers.

The table single-file checkpoints of SD3 and SD3.5 are read by (``preheat.models.single_file``),
in the same form as ``preheat.models.bfl``'s: one original module feeds one or more diffusers
layers, each a row range of it (``Piece``). Block ``i`` is ``joint_blocks.{i}``, an image half
(``x_block``) and a text half (``context_block``):

* ``attn.qkv`` holds q, k, v stacked (``to_q/k/v`` for the image, ``add_q/k/v_proj`` for the text);
* the last block's text half only feeds the image (diffusers' ``context_pre_only``): it has no
  ``attn.proj`` or ``mlp``, and its ``adaLN_modulation`` (like ``final_layer``'s) is an
  ``AdaLayerNormContinuous`` in diffusers, whose halves are (scale, shift) where the original's are
  (shift, scale), so its rows swap halves;
* SD3.5 adds RMS q/k norms (``attn.ln_q`` / ``ln_k``, with the config's ``qk_norm``) and, in the
  config's ``dual_attention_layers``, a second image-only attention ``x_block.attn2``.

``pos_embed`` is a parameter of its own, not a module (``MMDIT_PARAMS``).
"""

from __future__ import annotations

from typing import Any

from preheat.models.bfl import Piece

__all__ = ["MMDIT_PARAMS", "mmdit_modules"]

# original parameter -> diffusers parameter, for the tensors that are not a module's leaf
MMDIT_PARAMS = {"pos_embed": "pos_embed.pos_embed"}
_TOP = (("x_embedder.proj", "pos_embed.proj"), ("context_embedder", "context_embedder"),
        ("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
        ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
        ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
        ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
        ("final_layer.linear", "proj_out"))
# the one-to-one modules of every block: original suffix -> diffusers suffix
_IMAGE = (("x_block.attn.proj", "attn.to_out.0"), ("x_block.adaLN_modulation.1", "norm1.linear"),
          ("x_block.mlp.fc1", "ff.net.0.proj"), ("x_block.mlp.fc2", "ff.net.2"))
_TEXT = (("context_block.attn.proj", "attn.to_add_out"), ("context_block.adaLN_modulation.1", "norm1_context.linear"),
         ("context_block.mlp.fc1", "ff_context.net.0.proj"), ("context_block.mlp.fc2", "ff_context.net.2"))
_QK_NORMS = (("x_block.attn.ln_q", "attn.norm_q"), ("x_block.attn.ln_k", "attn.norm_k"),
             ("context_block.attn.ln_q", "attn.norm_added_q"), ("context_block.attn.ln_k", "attn.norm_added_k"))
_SECOND = (("x_block.attn2.proj", "attn2.to_out.0"),)
_SECOND_QK_NORMS = (("x_block.attn2.ln_q", "attn2.norm_q"), ("x_block.attn2.ln_k", "attn2.norm_k"))


def mmdit_modules(cfg: dict[str, Any]) -> dict[str, tuple[Piece, ...]]:
    """Original module name (dots, no leaf) -> the diffusers layers it feeds, for the blocks,
    widths, q/k norms and dual-attention blocks of an ``SD3Transformer2DModel`` config."""
    layers = int(cfg["num_layers"])
    inner = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    dual = set(cfg.get("dual_attention_layers") or ())
    qk_norm = cfg.get("qk_norm") is not None

    def qkv(*paths: str) -> tuple[Piece, ...]:
        return tuple(Piece(path, j * inner, (j + 1) * inner) for j, path in enumerate(paths))

    names = {orig: (Piece(path),) for orig, path in _TOP}
    names["final_layer.adaLN_modulation.1"] = (Piece("norm_out.linear", swap=True),)
    for i in range(layers):
        o, d = f"joint_blocks.{i}", f"transformer_blocks.{i}"
        last = i == layers - 1
        names[f"{o}.x_block.attn.qkv"] = qkv(f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v")
        names[f"{o}.context_block.attn.qkv"] = qkv(f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj")
        one = _IMAGE + (_TEXT[1:2] if last else _TEXT) + (_QK_NORMS if qk_norm else ())
        if i in dual:
            names[f"{o}.x_block.attn2.qkv"] = qkv(f"{d}.attn2.to_q", f"{d}.attn2.to_k", f"{d}.attn2.to_v")
            one += _SECOND + (_SECOND_QK_NORMS if qk_norm else ())
        names.update({f"{o}.{orig}": (Piece(f"{d}.{path}"),) for orig, path in one})
        if last:  # the text half's AdaLayerNormContinuous: (shift, scale) -> (scale, shift)
            names[f"{o}.context_block.adaLN_modulation.1"] = (Piece(f"{d}.norm1_context.linear", swap=True),)
    return names
