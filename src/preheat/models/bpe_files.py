"""CLIP byte-level BPE tokenizer files made from a word list (no download): the random-weight
benchmark folders' tokenizers and the built-in text-to-image model's.

``bpe_vocab(words)`` is CLIP's layout in miniature: the 256 byte characters, the same with the
``</w>`` end-of-word suffix, merges that make each word one token, then ``<|startoftext|>`` and
``<|endoftext|>`` as the last two ids (as in CLIP's own vocab).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

__all__ = ["BOS", "EOS", "bytes_to_unicode", "bpe_vocab", "write_clip_tokenizer"]

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """CLIP's (GPT-2's) byte -> printable unicode character table, in CLIP's vocab order."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=8)
def bpe_vocab(words: tuple[str, ...]) -> tuple[dict[str, int], tuple[str, ...]]:
    """A CLIP-style byte-level BPE vocab: 256 bytes, the same with ``</w>``, merges that make each
    of ``words`` one token, then ``<|startoftext|>`` and ``<|endoftext|>`` (the last ids, as in CLIP)."""
    table = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for c in table.values():
        vocab[c] = len(vocab)
    for c in table.values():
        vocab[c + "</w>"] = len(vocab)
    merges: list[str] = []
    for word in words:
        symbols = [table[b] for b in word.encode("utf-8")]
        symbols[-1] += "</w>"
        left = symbols[0]
        for right in symbols[1:]:
            if left + right not in vocab:
                vocab[left + right] = len(vocab)
                merges.append(f"{left} {right}")
            left = left + right
    vocab[BOS] = len(vocab)
    vocab[EOS] = len(vocab)
    return vocab, tuple(merges)


def write_clip_tokenizer(directory: Path, words: tuple[str, ...], pad_token: str = EOS) -> Path:
    """The four tokenizer files published diffusers folders hold."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = bpe_vocab(words)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": pad_token, "unk_token": EOS}))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": pad_token, "unk_token": EOS, "do_lower_case": True,
         "model_max_length": 77, "tokenizer_class": "CLIPTokenizer", "errors": "replace"}))
    return directory
