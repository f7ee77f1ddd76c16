"""T5's tokenizer (SentencePiece Unigram), read from a folder's ``tokenizer.json`` with ``tokenizers``.

Token for token what diffusers' Flux and SD3 pipelines get from transformers' ``T5TokenizerFast``
with ``tokenizer(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
add_special_tokens=True)``, without importing transformers, torch or sentencepiece.

transformers 5 does not run the pipeline stored in ``tokenizer.json`` as is: it keeps the file's
Unigram pieces and scores and its SentencePiece ``precompiled_charsmap``, and rebuilds the rest
(``T5Tokenizer.__init__``). This module rebuilds the same:

    normalizer      Precompiled(charsmap) when the file has one (published T5 files do), else none
    pre-tokenizer   WhitespaceSplit, then Metaspace("▁", prepend always, split)
    model           Unigram(pieces, unk_id=2, no byte fallback)
    added tokens    tokenizer_config.json's added_tokens_decoder (else tokenizer.json's list), the
                    named tokens (</s>, <unk>, <pad>) and the <extra_id_N> sentinels
    then            tokens[:max_length - 1] + [</s>], padded with <pad> (id 0) to max_length

(So whitespace runs, and leading or trailing whitespace, never make a lone "▁" token, whatever the
file's own pre-tokenizer says.) Tokenization runs on the host: the compiled encoder sees only
(B, max_length) int32 arrays.

Files read::

    tokenizer.json            required (published FLUX / SD3 folders ship it beside spiece.model)
    tokenizer_config.json     model_max_length, named tokens, added_tokens_decoder, extra ids
    special_tokens_map.json   named tokens, when tokenizer_config.json has no added_tokens_decoder
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from preheat.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError, UnsupportedConfigError
from preheat.models.tokenizer import added_token, token_content, named_and_added_tokens, prompt_list, warn_truncated
from preheat.models.safetensors_files import read_json

__all__ = ["T5Tokenizer", "T5_UNK_ID"]

# transformers' T5Tokenizer builds its Unigram with unk_id=2 whatever the file says; T5's <unk> is 2.
T5_UNK_ID = 2
_NAMED = ("eos_token", "unk_token", "pad_token")
_DEFAULTS = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
_METASPACE = "▁"


def _charsmap(normalizer: Any, where: str) -> bytes | None:
    """The SentencePiece precompiled charsmap of a tokenizer.json normalizer (alone or in a Sequence)."""
    if not normalizer:
        return None
    parts = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "Precompiled" and "precompiled_charsmap" in part:
            try:
                return base64.b64decode(part["precompiled_charsmap"])
            except (ValueError, TypeError):
                raise ModelFormatError(f"{where}: precompiled_charsmap is not base64") from None
    return None


def _unigram_pieces(raw: dict[str, Any], where: str) -> list[tuple[str, float]]:
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("type") != "Unigram":
        kind = model.get("type") if isinstance(model, dict) else None
        raise UnsupportedConfigError(
            f"{where} holds a {kind or 'missing'} model; a T5 tokenizer is a SentencePiece Unigram model")
    vocab = model.get("vocab")
    if (not isinstance(vocab, list) or len(vocab) <= T5_UNK_ID
            or not all(isinstance(v, (list, tuple)) and len(v) == 2 for v in vocab)):
        raise ModelFormatError(f"{where}: the Unigram vocab must be a list of [piece, score] pairs")
    return [(str(piece), float(score)) for piece, score in vocab]


@dataclass
class T5Tokenizer:
    """A folder's T5 tokenizer. ``encode(prompts) -> (B, max_length) int32``."""

    backend: Any  # tokenizers.Tokenizer: normalizer + pre-tokenizer + Unigram + added tokens, no post-processing
    max_length: int  # tokens per row, </s> included (FLUX: 256 schnell / 512 dev; SD3: 256 by default)
    eos_token_id: int
    pad_token: str
    pad_token_id: int
    source: str = ""

    @classmethod
    def from_folder(cls, folder: str | Path, max_length: int | None = None) -> "T5Tokenizer":
        """``max_length``: the pipeline's ``max_sequence_length``; default the folder's model_max_length."""
        from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
        from tokenizers.models import Unigram

        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise ModelNotFoundError(f"tokenizer folder {folder} does not exist")
        json_file = folder / "tokenizer.json"
        if not json_file.is_file():
            has_spm = (folder / "spiece.model").is_file()
            raise ModelNotFoundError(
                f"tokenizer folder {folder} has no tokenizer.json" + (
                    " (only spiece.model; preheat reads tokenizer.json, which transformers writes: "
                    "T5TokenizerFast.from_pretrained(p).save_pretrained(p))" if has_spm else ""))
        raw = read_json(json_file, "tokenizer")
        pieces = _unigram_pieces(raw, str(json_file))
        config_file = folder / "tokenizer_config.json"
        config = read_json(config_file, "tokenizer config") if config_file.is_file() else {}
        for side in ("padding_side", "truncation_side"):
            if config.get(side, "right") != "right":
                raise UnsupportedConfigError(
                    f"unsupported {side} {config[side]!r} in {config_file}; supported: 'right'")

        backend = Tokenizer(Unigram(pieces, unk_id=T5_UNK_ID, byte_fallback=False))
        charsmap = _charsmap(raw.get("normalizer"), str(json_file))
        if charsmap is not None:
            backend.normalizer = normalizers.Precompiled(charsmap)
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement=_METASPACE, prepend_scheme="always", split=True),
        ])
        backend.decoder = decoders.Metaspace(replacement=_METASPACE, prepend_scheme="always", split=True)

        # Added tokens as transformers 5 resolves them (see CLIPTokenizer): added_tokens_decoder wins;
        # without it, special_tokens_map.json and tokenizer.json's list. Then the named tokens and the
        # <extra_id_N> sentinels that are not there yet, as special, un-normalized tokens.
        entries, added = named_and_added_tokens(folder, config, config_file, raw, _NAMED)
        named = _DEFAULTS | {k: token_content(v, str(folder)) for k, v in entries.items()}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
        if extra is None:
            extra_ids = config.get("extra_ids", 0)
            extra = [f"<extra_id_{i}>" for i in range(extra_ids if isinstance(extra_ids, int) else 0)]
        if not isinstance(extra, list):
            raise ModelFormatError(f"{config_file}: extra_special_tokens must be a list")
        seen = {str(t.content) for t in added}
        for token in [entries.get(k, named[k]) for k in _NAMED] + extra:
            if token_content(token, str(config_file)) not in seen:
                added.append(added_token(token, str(config_file), special=True))
                seen.add(str(added[-1].content))
        backend.add_tokens(added)

        vocab = {piece for piece, _ in pieces}
        for k in ("eos_token", "pad_token"):
            # A token outside the Unigram vocab would get a fresh id past the encoder's embedding table.
            if named[k] not in vocab:
                raise ModelFormatError(f"{folder}: {k} {named[k]!r} is not in the vocabulary")
        if max_length is None:
            max_length = config.get("model_max_length")
            if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length > 1_000_000:
                raise InvalidArgumentError(
                    f"{config_file} gives no model_max_length; pass max_length (the pipeline's max_sequence_length)",
                    argument="max_sequence_length")
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
            raise InvalidArgumentError(f"max_length must be a positive integer, got {max_length!r}",
                                       argument="max_sequence_length")
        return cls(backend=backend, max_length=max_length, eos_token_id=backend.token_to_id(named["eos_token"]),
                   pad_token=named["pad_token"], pad_token_id=backend.token_to_id(named["pad_token"]),
                   source=str(folder))

    def encode(self, prompts: str | Sequence[str]) -> np.ndarray:
        """(B,) prompts -> (B, max_length) int32: tokens, </s>, <pad>...; long prompts truncated (warned)."""
        prompts = prompt_list(prompts)
        room = self.max_length - 1
        out = np.full((len(prompts), self.max_length), self.pad_token_id, dtype=np.int32)
        for row, encoding in enumerate(self.backend.encode_batch(prompts, add_special_tokens=False)):
            tokens = encoding.ids
            if len(tokens) > room:
                warn_truncated(len(tokens) - room, self.max_length, self.backend.decode(tokens[room:]))
                tokens = tokens[:room]
            out[row, :len(tokens)] = tokens
            out[row, len(tokens)] = self.eos_token_id
        return out

    __call__ = encode
