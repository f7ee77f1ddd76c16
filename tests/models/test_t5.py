"""preheat's T5 tokenizer and JAX T5 encoder vs transformers' T5TokenizerFast and T5EncoderModel."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from preheat.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError, UnsupportedConfigError
from preheat.models.t5_tokenizer import T5Tokenizer
from preheat.models.tokenizer import PromptTruncatedWarning
from tests.models.t5_fixtures import save_tiny_t5_tokenizer

PROMPTS = [
    "a photo of a cat",
    "",  # the unconditional prompt
    "   ",
    "  leading and trailing spaces  ",
    "A PHOTO   of\tthe\n\nDOG",  # whitespace runs, tabs, newlines and case
    "a sign that says \"hello world\"!",
    "(masterpiece:1.2), [blurry], {low quality}",
    "don't it's we're I'LL",
    "123 4k 8K 1920x1080 hdr",
    "café naïve über jalapeño",  # some accented letters are pieces, some are <unk>
    "emoji 😀 smile 🐱🐶",  # <unk> runs
    "中文 日本語 русский",
    "<extra_id_0> cat </s> dog <pad> <unk>",  # special tokens written in the prompt
    "a</s>b<extra_id_3>c",
    "x " * 63,  # exactly fills 64 with </s>: no truncation
    "x " * 64,  # one token over
    "watercolor painting of a fox " * 60,  # far over (300 tokens)
]


@pytest.fixture(scope="module", params=["transformers", "hub"])
def tok_folder(request, tmp_path_factory):
    return save_tiny_t5_tokenizer(tmp_path_factory.mktemp(f"t5tok-{request.param}"), layout=request.param)


def _reference(folder, prompts, max_length):
    from transformers import T5TokenizerFast

    ref = T5TokenizerFast.from_pretrained(str(folder))
    # exactly as diffusers' FluxPipeline._get_t5_prompt_embeds / SD3's _get_t5_prompt_embeds call it
    ids = ref(prompts, padding="max_length", max_length=max_length, truncation=True, return_length=False,
              return_overflowing_tokens=False, add_special_tokens=True).input_ids
    lengths = [len(x) for x in ref(prompts, add_special_tokens=False).input_ids]
    return np.asarray(ids), lengths, ref


@pytest.mark.parametrize("max_length", [64, 256])
def test_matches_transformers_token_for_token(tok_folder, max_length):
    ref_ids, lengths, ref = _reference(tok_folder, PROMPTS, max_length)
    tok = T5Tokenizer.from_folder(tok_folder, max_length=max_length)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ids = tok.encode(PROMPTS)
    assert ids.dtype == np.int32 and ids.shape == (len(PROMPTS), max_length) == ref_ids.shape
    for prompt, ours, theirs in zip(PROMPTS, ids, ref_ids):
        assert ours.tolist() == theirs.tolist(), f"prompt {prompt!r}"
    assert (tok.eos_token_id, tok.pad_token_id) == (ref.eos_token_id, ref.pad_token_id) == (1, 0)
    assert ids[1].tolist() == [1] + [0] * (max_length - 1)  # "" is </s> then padding
    over = [(p, n - (max_length - 1)) for p, n in zip(PROMPTS, lengths) if n > max_length - 1]
    messages = [str(w.message) for w in caught if issubclass(w.category, PromptTruncatedWarning)]
    assert len(messages) == len(over) == (2 if max_length == 64 else 1)
    for message, (_, dropped) in zip(messages, over):
        assert f"truncated: {dropped} token(s) past the {max_length}-token limit" in message


def test_exact_fit_is_not_truncated_and_one_more_is(tok_folder):
    tok = T5Tokenizer.from_folder(tok_folder, max_length=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit = tok.encode(["x " * 63])
    assert fit[0, -1] == tok.eos_token_id and tok.pad_token_id not in fit[0].tolist()
    with pytest.warns(PromptTruncatedWarning, match=r"truncated: 1 token\(s\) .*'x'"):
        over = tok.encode("x " * 64)  # a single string is a batch of one
    assert over.shape == (1, 64) and over.tolist() == fit.tolist()


def test_max_length_defaults_to_the_folder(tmp_path):
    folder = save_tiny_t5_tokenizer(tmp_path / "t", model_max_length=32)
    tok = T5Tokenizer.from_folder(folder)
    ref_ids, _, _ = _reference(folder, PROMPTS[:3], 32)
    assert tok.max_length == 32 and tok.encode(PROMPTS[:3]).tolist() == ref_ids.tolist()
    assert T5Tokenizer.from_folder(folder, max_length=8).encode("a").shape == (1, 8)


def test_bad_tokenizer_folders_are_one_line_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        T5Tokenizer.from_folder(tmp_path / "nope")
    folder = save_tiny_t5_tokenizer(tmp_path / "t", layout="hub")
    (folder / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    (folder / "spiece.model").write_bytes(b"\x0a\x00")  # published folders also ship the SentencePiece model
    with pytest.raises(ModelNotFoundError, match=r"has no tokenizer.json \(only spiece.model") as info:
        T5Tokenizer.from_folder(folder)
    assert "\n" not in str(info.value)
    (folder / "spiece.model").unlink()
    with pytest.raises(ModelNotFoundError, match=r"has no tokenizer.json$"):
        T5Tokenizer.from_folder(folder)
    raw = json.loads((tmp_path / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps(raw | {"model": {"type": "BPE", "vocab": {}, "merges": []}}))
    with pytest.raises(UnsupportedConfigError, match="holds a BPE model; a T5 tokenizer is a SentencePiece Unigram"):
        T5Tokenizer.from_folder(folder)
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="tokenizer.json is not valid JSON"):
        T5Tokenizer.from_folder(folder)
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"padding_side": "left"}))
    with pytest.raises(UnsupportedConfigError, match="unsupported padding_side 'left'"):
        T5Tokenizer.from_folder(folder)
    del config["model_max_length"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgumentError, match="no model_max_length; pass max_length"):
        T5Tokenizer.from_folder(folder)
    with pytest.raises(InvalidArgumentError, match="max_length must be a positive integer"):
        T5Tokenizer.from_folder(folder, max_length=0)


@pytest.mark.parametrize("prompts", [["ok", 3], [None], 7])
def test_prompt_that_is_not_a_string(tok_folder, prompts):
    with pytest.raises(InvalidArgumentError, match="prompt must be a string"):
        T5Tokenizer.from_folder(tok_folder, max_length=16).encode(prompts)
