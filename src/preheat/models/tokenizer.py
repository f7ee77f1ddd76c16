"""CLIP's tokenizer, read from a diffusers ``tokenizer/`` folder with the ``tokenizers`` library.

Token for token what diffusers' pipelines get from transformers' ``CLIPTokenizer`` with
``tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True)``,
without importing transformers or torch: the same ``tokenizers`` pipeline transformers 5 builds
(NFC, whitespace runs -> one space, lower-case; CLIP's word/number/punctuation split; byte-level
BPE with the ``</w>`` end-of-word suffix), the same added/special tokens, then BOS + tokens + EOS,
truncated to ``model_max_length`` (77) and padded with the folder's own pad token (SD 1.x pads
with ``<|endoftext|>``, SDXL's ``tokenizer_2`` with ``!``).

Tokenization runs on the host: the compiled text encoder only ever sees (B, 77) int32 arrays,
so a new prompt never retraces anything.

Files read, in the layouts found in diffusers folders::

    vocab.json + merges.txt          the BPE (published folders), or
    tokenizer.json                   the BPE inside (what transformers 5 ``save_pretrained`` writes)
    tokenizer_config.json            model_max_length, named tokens, added_tokens_decoder
    special_tokens_map.json          named tokens (read when tokenizer_config has no added_tokens_decoder,
                                     as transformers does)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from preheat.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError, UnsupportedConfigError
from preheat.models.safetensors_files import read_json

__all__ = ["CLIPTokenizer", "DEFAULT_MAX_LENGTH", "PromptTruncatedWarning", "prompt_list", "warn_truncated"]

# CLIP's context length; used when tokenizer_config.json gives none (or transformers' "unbounded" 1e30).
DEFAULT_MAX_LENGTH = 77

# transformers' CLIPTokenizer pre-tokenizer: special tokens, English contractions, letter runs,
# single digits, punctuation runs; whitespace is dropped.
_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")  # transformers' SPECIAL_TOKENS_ATTRIBUTES order
_DEFAULTS = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
             "pad_token": "<|endoftext|>"}
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


class PromptTruncatedWarning(UserWarning):
    """A prompt was longer than the tokenizer's model_max_length and its end was dropped."""


def prompt_list(prompts: Any) -> list[str]:
    """A prompt or a list of prompts as a list, or a one-line error (shared by every tokenizer)."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InvalidArgumentError(f"prompt must be a string or a list of strings, got {type(prompts).__name__}")
    for p in prompts:
        if not isinstance(p, str):
            raise InvalidArgumentError(f"prompt must be a string, got {type(p).__name__}")
    return list(prompts)


def warn_truncated(count: int, max_length: int, dropped: str) -> None:
    """One PromptTruncatedWarning per truncated prompt, pointing at the caller of ``encode``."""
    warnings.warn(f"prompt was truncated: {count} token(s) past the {max_length}-token limit were dropped: "
                  f"{dropped!r}", PromptTruncatedWarning, stacklevel=3)


def token_content(value: Any, where: str) -> str:
    """A named token as tokenizer files hold it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelFormatError(f"{where}: a token must be a string or an object with 'content', got {value!r}")


def added_token(entry: Any, where: str, special: bool | None = None) -> Any:
    from tokenizers import AddedToken

    if isinstance(entry, str):
        return AddedToken(entry, special=True, normalized=False)
    content = token_content(entry, where)
    flags = {k: entry[k] for k in _ADDED_TOKEN_FIELDS[1:] if k in entry}
    if special is not None:
        flags["special"] = special
    return AddedToken(content, **flags)


def named_and_added_tokens(folder: Path, config: dict[str, Any], config_file: Path,
                           tokenizer_json: dict[str, Any] | None,
                           names: Sequence[str]) -> tuple[dict[str, Any], list[Any]]:
    """Named tokens (``names``: bos/eos/unk/pad...) and added tokens, resolved as transformers 5
    does: tokenizer_config.json's added_tokens_decoder wins; without it, special_tokens_map.json
    and tokenizer.json's ``added_tokens`` list."""
    entries: dict[str, Any] = {k: config[k] for k in names if config.get(k) is not None}
    added: list[Any] = []
    if "added_tokens_decoder" in config:
        decoder = config["added_tokens_decoder"]
        if not isinstance(decoder, dict):
            raise ModelFormatError(f"{config_file}: added_tokens_decoder must be an object")
        added = [added_token(decoder[i], str(config_file)) for i in sorted(decoder, key=int)]
    else:
        special_file = folder / "special_tokens_map.json"
        if special_file.is_file():
            special_map = read_json(special_file, "special tokens map")
            entries |= {k: special_map[k] for k in names if special_map.get(k) is not None}
        if tokenizer_json is not None:
            where = str(folder / "tokenizer.json")
            added = [added_token(t, where) for t in tokenizer_json.get("added_tokens", [])]
    return entries, added


def _read_bpe(folder: Path) -> tuple[dict[str, int], list[tuple[str, str]], dict[str, Any] | None]:
    """Vocab, merges and (when read from tokenizer.json) that file's JSON."""
    from tokenizers.models import BPE

    vocab_file, merges_file, json_file = folder / "vocab.json", folder / "merges.txt", folder / "tokenizer.json"
    if vocab_file.is_file() and merges_file.is_file():
        try:
            vocab, merges = BPE.read_file(str(vocab_file), str(merges_file))
        except Exception as exc:  # tokenizers raises plain Exception with a one-line reason
            raise ModelFormatError(f"{folder}: cannot read vocab.json/merges.txt: {str(exc).splitlines()[0]}") from None
        return vocab, merges, None
    if json_file.is_file():
        raw = read_json(json_file, "tokenizer")
        model = raw.get("model")
        if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            raise UnsupportedConfigError(f"{json_file} does not hold a BPE model; a CLIP tokenizer is byte-level BPE")
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
        if any(len(m) != 2 for m in merges):
            raise ModelFormatError(f"{json_file}: every merge must be a pair of tokens")
        return dict(model["vocab"]), merges, raw
    missing = merges_file.name if vocab_file.is_file() else vocab_file.name
    raise ModelNotFoundError(f"tokenizer folder {folder} has no {missing} (nor tokenizer.json)")


@dataclass
class CLIPTokenizer:
    """A folder's CLIP tokenizer. ``encode(prompts) -> (B, max_length) int32``."""

    backend: Any  # tokenizers.Tokenizer: normalizer + pre-tokenizer + BPE + added tokens, no post-processing
    max_length: int
    bos_token_id: int
    eos_token_id: int
    pad_token: str
    pad_token_id: int
    source: str = ""

    @classmethod
    def from_folder(cls, folder: str | Path) -> "CLIPTokenizer":
        from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
        from tokenizers.models import BPE

        folder = Path(folder).expanduser()
        if not folder.is_dir():
            raise ModelNotFoundError(f"tokenizer folder {folder} does not exist")
        vocab, merges, tokenizer_json = _read_bpe(folder)
        config_file = folder / "tokenizer_config.json"
        config = read_json(config_file, "tokenizer config") if config_file.is_file() else {}
        for side in ("padding_side", "truncation_side"):
            if config.get(side, "right") != "right":
                raise UnsupportedConfigError(
                    f"unsupported {side} {config[side]!r} in {config_file}; supported: 'right'")

        entries, added = named_and_added_tokens(folder, config, config_file, tokenizer_json, _NAMED)
        named = _DEFAULTS | {k: token_content(v, str(folder)) for k, v in entries.items()}

        try:
            backend = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                    end_of_word_suffix="</w>", fuse_unk=False, unk_token=named["unk_token"]))
        except Exception as exc:
            raise ModelFormatError(f"{folder}: invalid BPE vocab/merges: {str(exc).splitlines()[0]}") from None
        backend.normalizer = normalizers.Sequence(
            [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ])
        backend.decoder = decoders.ByteLevel()
        # Then the named tokens, in transformers' order, each re-added (the last flags for a content win,
        # as in ``tokenizers``): an added token of the same content, else the flags its file gives (a bare
        # string: not normalized). Whether "<|ENDOFTEXT|>" in a prompt is matched depends on this.
        final = {str(t.content): t for t in added}
        for k in _NAMED:
            final[named[k]] = next((t for t in added if str(t.content) == named[k]), None) or added_token(
                entries.get(k, named[k]), str(folder), special=True)
        backend.add_tokens(list(final.values()))

        ids = {}
        for k in ("bos_token", "eos_token", "pad_token"):
            # A token outside the BPE vocab would get a fresh id past the text encoder's embedding table.
            if named[k] not in vocab:
                raise ModelFormatError(f"{folder}: {k} {named[k]!r} is not in the vocabulary")
            ids[k] = backend.token_to_id(named[k])
        max_length = config.get("model_max_length", DEFAULT_MAX_LENGTH)
        if not isinstance(max_length, (int, float)) or max_length > 1e6:
            max_length = DEFAULT_MAX_LENGTH  # transformers writes 1e30 for "no limit"
        if int(max_length) < 2:
            raise UnsupportedConfigError(f"model_max_length {max_length} in {config_file} leaves no room for BOS/EOS")
        return cls(backend=backend, max_length=int(max_length), bos_token_id=ids["bos_token"],
                   eos_token_id=ids["eos_token"], pad_token=named["pad_token"], pad_token_id=ids["pad_token"],
                   source=str(folder))

    def encode(self, prompts: str | Sequence[str]) -> np.ndarray:
        """(B,) prompts -> (B, max_length) int32: BOS, tokens, EOS, pad tokens; long prompts truncated."""
        prompts = prompt_list(prompts)
        room = self.max_length - 2
        out = np.full((len(prompts), self.max_length), self.pad_token_id, dtype=np.int32)
        for row, encoding in enumerate(self.backend.encode_batch(list(prompts), add_special_tokens=False)):
            tokens = encoding.ids
            if len(tokens) > room:
                dropped = self.backend.decode(tokens[room:]).replace("</w>", " ").strip()
                warn_truncated(len(tokens) - room, self.max_length, dropped)
                tokens = tokens[:room]
            out[row, 0] = self.bos_token_id
            out[row, 1:len(tokens) + 1] = tokens
            out[row, len(tokens) + 1] = self.eos_token_id
        return out

    __call__ = encode
