"""Tiny T5 encoder and tokenizer folders, made by the tests (nothing is downloaded).

Reusable by pipeline tests (FLUX ``text_encoder_2``/``tokenizer_2``, SD3 ``text_encoder_3``/``tokenizer_3``)::

    save_tiny_t5_tokenizer(dir, vocab_size=1000, extra_ids=10, model_max_length=512, layout="transformers")
        -> dir                                                                   (T5TokenizerFast.save_pretrained)
    save_tiny_t5_encoder(dir, seed=0, **config_overrides) -> dir                 (T5EncoderModel.save_pretrained)
    tiny_t5_config(**overrides) -> dict                                          (transformers T5Config kwargs)
    tiny_t5_pieces(vocab_size=1000, extra_ids=10) -> [(piece, score)]            (the Unigram vocab)
    tiny_precompiled_charsmap() -> bytes                                         (a one-entry SentencePiece charsmap)
    t5_reference(dir, input_ids, attention_mask=None) -> (B, L, d_model) numpy   (transformers, fp32)

The tokenizer is a real SentencePiece-style Unigram (T5's layout: <pad>=0, </s>=1, <unk>=2, "▁",
pieces, then the <extra_id_N> sentinels last, in reverse) with ``vocab_size`` ids in all, so with
the defaults its ids are exactly the tiny encoder's vocabulary (1000, as diffusers' Flux tests).
Its normalizer is a SentencePiece precompiled charsmap, as in published T5 tokenizers, but a
one-entry one written here (NFKC's "ﬁ" -> "fi"; ``tiny_precompiled_charsmap``), since building
T5's real nmt_nfkc map needs sentencepiece.
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

T5_WORDS = (
    "a photo of the cat dog on in with and an astronaut riding horse mars painting oil watercolor fox "
    "blurry low quality high detailed portrait woman man city night street light sunset over mountains "
    "lake forest red blue green yellow black white by trending artstation hdr sign that says hello world"
).split()
_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()[]{}-_/\\|@#$%&*+=<>~éèüñç"

# diffusers' tiny Flux/SD3 T5 scale.
TINY_T5 = dict(vocab_size=1000, d_model=32, d_ff=37, num_heads=4, d_kv=8, num_layers=2,
               relative_attention_num_buckets=8, relative_attention_max_distance=128,
               feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1,
               decoder_start_token_id=0)


def tiny_t5_pieces(vocab_size: int = 1000, extra_ids: int = 10) -> list[tuple[str, float]]:
    """(piece, log-probability) in T5's id order, ``vocab_size`` entries."""
    head = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    body = [("▁" + w, -3.0 - 0.01 * i) for i, w in enumerate(T5_WORDS)]
    body += [(c, -9.0 - 0.001 * i) for i, c in enumerate(_CHARS)]
    body += [("▁" + c, -8.0 - 0.001 * i) for i, c in enumerate(_CHARS[:26])]
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    grams = [a + b for a in letters for b in letters] + ["▁" + a + b for a in letters for b in letters]
    room = vocab_size - len(head) - extra_ids
    if room < len(body):
        need = len(head) + len(body) + extra_ids
        raise ValueError(f"vocab_size {vocab_size} is too small for the tiny T5 vocab (needs {need})")
    seen = {p for p, _ in head + body}
    body += [(g, -6.0 - 0.002 * i) for i, g in enumerate(g for g in grams if g not in seen)][:room - len(body)]
    if len(body) < room:
        raise ValueError(f"vocab_size {vocab_size} is too large for the tiny T5 vocab")
    tail = [(f"<extra_id_{i}>", 0.0) for i in range(extra_ids - 1, -1, -1)]
    return head + body + tail


def tiny_precompiled_charsmap(key: str = "\ufb01", value: str = "fi") -> bytes:
    """A SentencePiece precompiled charsmap mapping one character to ``value``.

    The format ``tokenizers``' Precompiled normalizer reads: u32 trie size in bytes, a darts-clone
    double-array trie of u32 units (offset << 10 | has_leaf << 8 | label; a leaf unit has bit 31
    and the value: an offset into the blob), then the NUL-terminated normalized strings.
    """
    data = key.encode()
    if not 1 <= len(data) <= 4:
        raise ValueError("the key must be one to four UTF-8 bytes")
    offsets = [256, 512, 1024, 2048, 4096]  # every child position is base ^ byte: no two collide
    units: dict[int, int] = {0: offsets[0] << 10}
    base = offsets[0]
    for i, byte in enumerate(data):
        pos = base ^ byte
        units[pos] = (offsets[i + 1] << 10) | (int(i == len(data) - 1) << 8) | byte
        base = pos ^ offsets[i + 1]
    units[base] = 0x80000000  # the leaf: value 0, the first string of the blob
    array = [units.get(i, 0) for i in range(max(units) + 1)]
    trie = struct.pack(f"<{len(array)}I", *array)
    return struct.pack("<I", len(trie)) + trie + value.encode() + b"\0"


def save_tiny_t5_tokenizer(directory: str | Path, vocab_size: int = 1000, extra_ids: int = 10,
                           model_max_length: int = 512, layout: str = "transformers") -> Path:
    """A T5 tokenizer folder.

    ``layout="transformers"``: what transformers 5 ``save_pretrained`` writes (tokenizer.json +
    tokenizer_config.json). ``layout="hub"``: the files as published FLUX/SD3 folders hold them
    (written by transformers 4.x): tokenizer.json with the file's own single Metaspace pre-tokenizer
    and its normalizer (the charsmap, then whitespace runs collapsed), tokenizer_config.json with added_tokens_decoder and
    additional_special_tokens, and special_tokens_map.json (spiece.model is not written: no
    sentencepiece here).
    """
    from transformers import T5TokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    charsmap = tiny_precompiled_charsmap()
    tok = T5TokenizerFast(vocab=tiny_t5_pieces(vocab_size, extra_ids), extra_ids=extra_ids,
                          model_max_length=model_max_length, _spm_precompiled_charsmap=charsmap)
    tok.save_pretrained(str(directory))
    if layout == "transformers":
        return directory
    if layout != "hub":
        raise ValueError(f"layout must be 'transformers' or 'hub', got {layout!r}")
    path = directory / "tokenizer.json"
    raw = json.loads(path.read_text())
    raw["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(charsmap).decode()},
        {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]}
    raw["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    path.write_text(json.dumps(raw, ensure_ascii=False))
    added = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in raw["added_tokens"]}
    sentinels = [f"<extra_id_{i}>" for i in range(extra_ids)]
    config = {"added_tokens_decoder": added, "additional_special_tokens": sentinels,
              "clean_up_tokenization_spaces": True, "eos_token": "</s>", "extra_ids": extra_ids, "legacy": True,
              "model_max_length": model_max_length, "pad_token": "<pad>", "sp_model_kwargs": {},
              "tokenizer_class": "T5Tokenizer", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"additional_special_tokens": sentinels,
               **{k: {"content": v, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
                  for k, v in (("eos_token", "</s>"), ("pad_token", "<pad>"), ("unk_token", "<unk>"))}}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return directory


def tiny_t5_config(**overrides: Any) -> dict[str, Any]:
    """transformers T5Config kwargs for a T5EncoderModel at diffusers' tiny Flux scale."""
    return dict(TINY_T5) | overrides


def save_tiny_t5_encoder(directory: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight transformers ``T5EncoderModel`` folder (config.json + model.safetensors).

    Every weight (the RMSNorm scales too) gets noise, so a mis-mapped tensor shows.
    """
    import torch
    from transformers import T5Config, T5EncoderModel

    directory = Path(directory)
    torch.manual_seed(seed)
    model = T5EncoderModel(T5Config(**tiny_t5_config(**overrides))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p) if "layer_norm" in name else 0.02 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    return directory


def t5_reference(directory: str | Path, input_ids: np.ndarray, attention_mask: np.ndarray | None = None,
                 dtype: Any = None) -> np.ndarray:
    """transformers' ``last_hidden_state`` (as float32 numpy) for ``input_ids``; ``dtype`` a torch dtype."""
    import torch
    from transformers import T5EncoderModel

    model = T5EncoderModel.from_pretrained(str(directory), dtype=dtype or torch.float32).eval()
    mask = None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask, np.int64))
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(input_ids, np.int64)), attention_mask=mask).last_hidden_state
    return out.float().numpy()
