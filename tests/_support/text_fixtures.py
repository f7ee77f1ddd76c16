"""Tiny CLIP text-encoder and tokenizer folders, made by the tests (nothing is downloaded).

Reusable by pipeline tests::

    save_tiny_clip(dir, with_projection=False, **config_overrides) -> dir   (transformers save_pretrained)
    save_tiny_tokenizer(dir, pad_token="<|endoftext|>", layout="hub") -> dir
    tiny_clip_config(**overrides) -> dict                                  (transformers CLIPTextConfig kwargs)
    clip_reference(dir, input_ids) -> dict of numpy outputs                 (transformers, fp32)

The tokenizer is a real CLIP byte-level BPE: the 256 byte characters, each also with the
``</w>`` end-of-word suffix, merges for a small word list, then ``<|startoftext|>`` and
``<|endoftext|>`` (the last two ids, as in CLIP's own vocab); ``tiny_clip_config()`` has the
same vocab size and BOS/EOS ids, so the tokenizer's output is the tiny encoder's input.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from preheat.bench.random_models import bpe_vocab

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"

# Words whose merges the tiny vocab holds (whole words become one token, as in CLIP's vocab).
WORDS = (
    "a photo of the cat dog on in with and an astronaut riding horse mars painting oil watercolor fox "
    "blurry low quality high detailed portrait woman man city night street light sunset over mountains "
    "lake forest red blue green yellow black white by greg trending artstation 4k 8k hdr ing ed er s "
    "café naïve über jalapeño"
).split()


@lru_cache(maxsize=1)
def tiny_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """A CLIP-style BPE vocab (~700 tokens) and its merges."""
    vocab, merges = bpe_vocab(tuple(WORDS))
    return dict(vocab), list(merges)


def _added_token(content: str, *, normalized: bool, special: bool) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": normalized, "rstrip": False,
            "single_word": False, "special": special}


def save_tiny_tokenizer(directory: str | Path, pad_token: str = EOS, layout: str = "hub",
                        model_max_length: int = 77) -> Path:
    """A CLIP tokenizer folder.

    ``layout="hub"``: exactly the four files diffusers folders publish (vocab.json, merges.txt,
    special_tokens_map.json, tokenizer_config.json), written as transformers 4.3x wrote them
    (SDXL's: ``added_tokens_decoder``, with ``!`` a special token when it is the pad token).
    ``layout="legacy"``: the same four files as 2022's transformers wrote them (SD 1.x / 2.x):
    named tokens as ``__type: AddedToken`` objects, all normalized, no ``added_tokens_decoder``.
    ``layout="transformers"``: what transformers 5.x ``save_pretrained`` writes
    (tokenizer.json + tokenizer_config.json).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = tiny_vocab_and_merges()
    hub = directory / "_hub" if layout == "transformers" else directory
    hub.mkdir(parents=True, exist_ok=True)
    (hub / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (hub / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    def entry(content: str, normalized: bool) -> dict[str, Any]:  # AddedToken as special_tokens_map.json holds it
        return {k: v for k, v in _added_token(content, normalized=normalized, special=False).items() if k != "special"}

    legacy = layout == "legacy"  # 2022 files (SD 1.x/2.x): every named token normalized, no added_tokens_decoder
    special = {"bos_token": entry(BOS, True), "eos_token": entry(EOS, legacy), "pad_token": pad_token,
               "unk_token": entry(EOS, legacy)}
    (hub / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    added = {str(vocab[BOS]): _added_token(BOS, normalized=True, special=False),
             str(vocab[EOS]): _added_token(EOS, normalized=False, special=False)}
    if pad_token not in (BOS, EOS):
        added = {str(vocab[pad_token]): _added_token(pad_token, normalized=False, special=True), **added}
    config = {"add_prefix_space": False, "added_tokens_decoder": added, "additional_special_tokens": [],
              "bos_token": BOS, "clean_up_tokenization_spaces": True, "do_lower_case": True, "eos_token": EOS,
              "errors": "replace", "model_max_length": model_max_length, "pad_token": pad_token,
              "tokenizer_class": "CLIPTokenizer", "unk_token": EOS}
    if legacy:
        del config["added_tokens_decoder"], config["additional_special_tokens"]
        for k in ("bos_token", "eos_token", "unk_token"):
            config[k] = {"__type": "AddedToken", **special[k]}
    (hub / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if layout in ("hub", "legacy"):
        return directory
    if layout != "transformers":
        raise ValueError(f"layout must be 'hub', 'legacy' or 'transformers', got {layout!r}")
    import shutil

    from transformers import CLIPTokenizer

    CLIPTokenizer.from_pretrained(str(hub)).save_pretrained(str(directory))
    shutil.rmtree(hub)
    return directory


def tiny_clip_config(**overrides: Any) -> dict[str, Any]:
    """transformers CLIPTextConfig kwargs: hidden 32, 2 layers, 4 heads, the tiny tokenizer's vocab.

    As in CLIP, <|endoftext|> is the highest id (vocab_size - 1) and <|startoftext|> the one before,
    so the encoder reads ``save_tiny_tokenizer``'s ids and both pooling rules find the EOS.
    """
    vocab, _ = tiny_vocab_and_merges()
    return dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=37, projection_dim=24, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                bos_token_id=vocab[BOS], eos_token_id=vocab[EOS], pad_token_id=1) | overrides


def save_tiny_clip(directory: str | Path, with_projection: bool = False, seed: int = 0, hub_layout: bool = False,
                   **overrides: Any) -> Path:
    """A random-weight transformers CLIP text encoder folder (config.json + model.safetensors).

    Every weight (LayerNorm and biases included) gets random noise so a mis-mapped tensor shows.
    ``hub_layout=True`` rewrites the file as transformers 4.x saved it (``text_model.`` prefix on
    every key, plus the ``position_ids`` buffer) -- the layout of published diffusers folders.
    """
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    directory = Path(directory)
    torch.manual_seed(seed)
    config = CLIPTextConfig(**tiny_clip_config(**overrides))
    model = (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    if hub_layout:
        from safetensors.torch import load_file, save_file

        path = directory / "model.safetensors"
        tensors = {(k if k.startswith(("text_model.", "text_projection.")) else f"text_model.{k}"): v
                   for k, v in load_file(str(path)).items()}
        tensors["text_model.embeddings.position_ids"] = torch.arange(config.max_position_embeddings)[None]
        save_file(tensors, str(path))
    return directory


def clip_reference(directory: str | Path, input_ids: np.ndarray) -> dict[str, Any]:
    """transformers' outputs (fp32) for ``input_ids``: last, hidden_states, pooled, text_embeds."""
    import torch
    from transformers import AutoConfig, CLIPTextModel, CLIPTextModelWithProjection

    arch = AutoConfig.from_pretrained(str(directory)).architectures[0]
    cls = CLIPTextModelWithProjection if arch == "CLIPTextModelWithProjection" else CLIPTextModel
    model = cls.from_pretrained(str(directory)).eval()
    ids = torch.as_tensor(np.asarray(input_ids, np.int64))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        if cls is CLIPTextModel:
            pooled, embeds = out.pooler_output, None
        else:  # the projection model does not return the pooled state: take it from its text_model
            pooled, embeds = model.text_model(ids).pooler_output, out.text_embeds
    return {
        "last_hidden_state": out.last_hidden_state.numpy(),
        "hidden_states": [h.numpy() for h in out.hidden_states],
        "pooled": pooled.numpy(),
        "text_embeds": None if embeds is None else embeds.numpy(),
    }
