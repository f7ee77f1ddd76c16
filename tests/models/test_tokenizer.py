"""preheat's CLIP tokenizer vs transformers' CLIPTokenizer, called as diffusers' pipelines call it."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pytest

from preheat.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError, UnsupportedConfigError
from preheat.models.tokenizer import CLIPTokenizer, PromptTruncatedWarning
from tests._support.text_fixtures import EOS, save_tiny_tokenizer, tiny_vocab_and_merges

PROMPTS = [
    "a photo of a cat",
    "",  # the unconditional prompt
    "   ",
    "An Astronaut Riding a Horse on Mars",
    "A PHOTO   of\tthe\n\nDOG",  # whitespace runs and case
    "  leading and trailing spaces  ",
    "hello!",  # SDXL's tokenizer_2: "!" is its pad token, an added token
    "!",
    "wow!!! really?!",
    "a,b.c;d:e/f\\g|h",
    "(masterpiece:1.2), [blurry], {low quality}",
    "don't it's we're I'LL you've they'd I'm",
    "123 4k 8K 1920x1080 hdr",
    "café naïve über jalapeño",
    "CAFÉ NAÏVE",
    "cafe\u0301 (decomposed accent)",  # NFC folds it into é
    "Ｆｕｌｌｗｉｄｔｈ ｔｅｘｔ",
    "emoji 😀 smile 🐱🐶",
    "中文 日本語 한국어 русский ελληνικά",
    "tab\tand\u00a0no-break\u2003em space",
    "<|startoftext|>cat<|endoftext|>",
    "<|ENDOFTEXT|> upper-case special",  # matched only where the file says the token is normalized
    "<|StartOfText|>x<|endoftext|>y",
    "a__b--c..d",
    "oil painting by greg, trending on artstation, 8k, highly detailed",
    "portrait of a woman, red hair, green eyes, forest at sunset over mountains and a lake",
    "x " * 75,  # exactly fills 77 with BOS/EOS: no truncation
    "x " * 76,  # one token over
    "watercolor " * 90,  # far over
    "a very long prompt, " * 20,
    "blurry, low quality, " * 30 + "THE END",
]


@pytest.fixture(scope="module", params=[("<|endoftext|>", "hub"), ("!", "hub"), ("<|endoftext|>", "legacy"),
                                        ("!", "legacy"), ("<|endoftext|>", "transformers"), ("!", "transformers")],
                ids=["sd-hub", "sdxl2-hub", "sd-2022", "sdxl2-2022", "sd-v5", "sdxl2-v5"])
def folder(request, tmp_path_factory):
    pad, layout = request.param
    return save_tiny_tokenizer(tmp_path_factory.mktemp(layout), pad_token=pad, layout=layout), pad, layout


def _reference(folder, prompts):
    from transformers import CLIPTokenizer as Reference

    ref = Reference.from_pretrained(str(folder))
    ids = ref(prompts, padding="max_length", max_length=ref.model_max_length, truncation=True).input_ids
    lengths = [len(x) for x in ref(prompts, add_special_tokens=False).input_ids]
    return np.asarray(ids), lengths, ref


def test_folder_layouts_are_the_published_and_the_v5_files(folder):
    path, _, layout = folder
    files = {p.name for p in path.iterdir()}
    if layout in ("hub", "legacy"):
        assert files == {"vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json"}
    else:
        assert files == {"tokenizer.json", "tokenizer_config.json"}


def test_matches_transformers_token_for_token(folder):
    path, pad, _ = folder
    ref_ids, lengths, ref = _reference(path, PROMPTS)
    tok = CLIPTokenizer.from_folder(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ids = tok.encode(PROMPTS)
    assert ids.dtype == np.int32 and ids.shape == (len(PROMPTS), 77) == ref_ids.shape
    for prompt, ours, theirs in zip(PROMPTS, ids, ref_ids):
        assert ours.tolist() == theirs.tolist(), f"prompt {prompt!r}"
    # the pad token is the folder's own
    assert tok.pad_token == pad and tok.pad_token_id == ref.pad_token_id
    assert ids[0, -1] == tok.pad_token_id
    assert (tok.pad_token_id == tok.eos_token_id) == (pad == EOS)
    # one warning per truncated prompt, saying how many tokens were dropped
    over = [(p, n - 75) for p, n in zip(PROMPTS, lengths) if n > 75]
    assert [p for p, _ in over] == PROMPTS[-4:]
    messages = [str(w.message) for w in caught if issubclass(w.category, PromptTruncatedWarning)]
    assert len(messages) == len(over)
    for message, (_, dropped) in zip(messages, over):
        assert "truncated" in message and f"{dropped} token(s)" in message


def test_exact_fit_is_not_truncated_and_one_more_is(folder):
    path, _, _ = folder
    tok = CLIPTokenizer.from_folder(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit = tok.encode(["x " * 75])
    assert fit[0, -1] == tok.eos_token_id and fit[0, 0] == tok.bos_token_id
    with pytest.warns(PromptTruncatedWarning, match=r"truncated: 1 token\(s\)"):
        over = tok.encode("x " * 76)  # a single string is a batch of one
    assert over.shape == (1, 77) and over.tolist() == fit.tolist()


def test_empty_prompt_is_bos_eos_then_pad(folder):
    path, _, _ = folder
    tok = CLIPTokenizer.from_folder(path)
    ids = tok.encode([""])[0]
    vocab, _ = tiny_vocab_and_merges()
    assert ids[:2].tolist() == [vocab["<|startoftext|>"], vocab["<|endoftext|>"]]
    assert set(ids[2:].tolist()) == {vocab[tok.pad_token]}


def test_model_max_length_from_the_folder(tmp_path):
    path = save_tiny_tokenizer(tmp_path / "t", model_max_length=16)
    tok = CLIPTokenizer.from_folder(path)
    prompts = ["a photo of a cat", "watercolor " * 20]
    ref_ids, _, _ = _reference(path, prompts)
    with pytest.warns(PromptTruncatedWarning, match=r"6 token\(s\) past the 16-token limit"):
        ids = tok.encode(prompts)
    assert ids.shape == (2, 16) and ids.tolist() == ref_ids.tolist()


# ----------------------------------------------------------------------------------------------
# Bad folders and bad prompts


def test_missing_folder_and_files_name_the_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="tokenizer folder .* does not exist"):
        CLIPTokenizer.from_folder(tmp_path / "nope")
    path = save_tiny_tokenizer(tmp_path / "t")
    (path / "merges.txt").unlink()
    with pytest.raises(ModelNotFoundError, match=r"has no merges.txt \(nor tokenizer.json\)") as info:
        CLIPTokenizer.from_folder(path)
    assert "\n" not in str(info.value)
    (path / "vocab.json").unlink()
    with pytest.raises(ModelNotFoundError, match=r"has no vocab.json"):
        CLIPTokenizer.from_folder(path)


def test_malformed_and_unsupported_files(tmp_path):
    path = save_tiny_tokenizer(tmp_path / "t")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"padding_side": "left"}))
    with pytest.raises(UnsupportedConfigError, match="unsupported padding_side 'left'"):
        CLIPTokenizer.from_folder(path)
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="tokenizer_config.json is not valid JSON"):
        CLIPTokenizer.from_folder(path)
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"pad_token": "<|nope|>"}))
    (path / "special_tokens_map.json").unlink()
    with pytest.raises(ModelFormatError, match=r"pad_token '<\|nope\|>' is not in the vocabulary"):
        CLIPTokenizer.from_folder(path)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "merges.txt").write_text("#version: 0.2\nq zzz\n")
    with pytest.raises(ModelFormatError, match=r"invalid BPE vocab/merges.*zzz"):
        CLIPTokenizer.from_folder(path)


@pytest.mark.parametrize("prompts", [["ok", 3], [None], 7, [b"bytes"]])
def test_prompt_that_is_not_a_string(tmp_path, prompts):
    tok = CLIPTokenizer.from_folder(save_tiny_tokenizer(tmp_path / "t"))
    with pytest.raises(InvalidArgumentError, match="prompt must be a string"):
        tok.encode(prompts)


def test_no_torch_or_transformers_at_run_time(tmp_path):
    """Tokenizing and loading an encoder in a fresh process import neither torch nor transformers."""
    from tests._support.text_fixtures import save_tiny_clip

    tok_dir = save_tiny_tokenizer(tmp_path / "tok", pad_token="!")
    clip_dir = save_tiny_clip(tmp_path / "enc", with_projection=True, num_hidden_layers=1)
    code = (
        "import sys\n"
        "from preheat.models.tokenizer import CLIPTokenizer\n"
        "from preheat.models.clip import load_clip_text\n"
        f"ids = CLIPTokenizer.from_folder({str(tok_dir)!r}).encode(['a photo of a cat'])\n"
        f"encoder = load_clip_text({str(clip_dir)!r})\n"
        "assert ids.shape == (1, 77) and encoder.config.with_projection\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not bad, bad\n"
    )
    src = str(__import__("preheat").__file__).rsplit("/preheat/", 1)[0]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": src, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
