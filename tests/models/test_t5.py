"""preheat's T5 tokenizer and JAX T5 encoder vs transformers' T5TokenizerFast and T5EncoderModel."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from preheat.errors import (InvalidArgumentError, ModelFormatError, ModelNotFoundError, UnsupportedConfigError,
                            WeightsError)
from preheat.models import t5 as t5_mod
from preheat.models.t5 import T5Config, load_t5_encoder, relative_position_buckets
from preheat.models.t5_tokenizer import T5Tokenizer
from preheat.models.tokenizer import PromptTruncatedWarning
from preheat.models.weights import expected_torch_shape, torch_key
from tests._support.t5_fixtures import save_tiny_t5_encoder, save_tiny_t5_tokenizer, t5_reference

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
    "the \ufb01re \ufb01eld",  # the charsmap maps the ligature to "fi"
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


def test_the_folder_charsmap_normalizes(tok_folder):
    raw = json.loads((tok_folder / "tokenizer.json").read_text())
    assert "Precompiled" in json.dumps(raw["normalizer"])
    tok = T5Tokenizer.from_folder(tok_folder, max_length=16)
    assert tok.encode("the \ufb01re").tolist() == tok.encode("the fire").tolist()
    assert 2 not in tok.encode("the fire")[0].tolist()  # no <unk>: the ligature was mapped


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


# ----------------------------------------------------------------------------------------------
# The encoder

FP32_REL_TOL = 1e-5  # of the largest |value|; measured about 5e-7

# The published FLUX text_encoder_2 / SD3 text_encoder_3 config.json (T5 v1.1 XXL), as transformers 4.x wrote it.
T5_XXL = {
    "architectures": ["T5EncoderModel"], "classifier_dropout": 0.0, "d_ff": 10240, "d_kv": 64, "d_model": 4096,
    "decoder_start_token_id": 0, "dense_act_fn": "gelu_new", "dropout_rate": 0.1, "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu", "initializer_factor": 1.0, "is_encoder_decoder": True, "is_gated_act": True,
    "layer_norm_epsilon": 1e-06, "model_type": "t5", "num_decoder_layers": 24, "num_heads": 64, "num_layers": 24,
    "output_past": True, "pad_token_id": 0, "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.3", "use_cache": True, "vocab_size": 32128,
}

# (name, config overrides): diffusers' tiny Flux T5, then the variations that could hide a mistake.
CASES = [
    ("tiny-flux", {}),
    ("three-layers-long-range", dict(num_layers=3, num_heads=2, d_kv=16, relative_attention_num_buckets=32,
                                     relative_attention_max_distance=16)),  # L=40 reaches the log bins and past
    ("inner-width-not-d_model", dict(num_heads=3, d_kv=6, d_ff=20)),  # H*Dk = 18
    ("v1.0-relu", dict(feed_forward_proj="relu")),
    ("gated-silu", dict(feed_forward_proj="gated-silu")),
    ("five-layers-scanned", dict(num_layers=5)),  # blocks 1..4 one scan (stacking.scan_min 3)
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def enc_case(request, tmp_path_factory):
    name, overrides = request.param
    return name, save_tiny_t5_encoder(tmp_path_factory.mktemp(name), **overrides)


def _ids_and_mask(length: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """Token rows as the tokenizer makes them: words, </s> (1), then <pad> (0); one row full."""
    rng = np.random.RandomState(0)
    ids = rng.randint(3, 1000, size=(3, length))
    ends = [10, length - 1, 0]  # a short prompt, a truncated one, the empty prompt
    for row, end in enumerate(ends):
        ids[row, end], ids[row, end + 1:] = 1, 0
    mask = (np.arange(length)[None, :] <= np.asarray(ends)[:, None]).astype(np.int64)  # (B, L)
    return ids, mask


def _stacked(enc) -> bool:
    return any("stacked" in map(str, k) for k, _ in nnx.to_flat_state(enc.params))


def _rel_err(ours, ref) -> float:
    ref = np.asarray(ref, np.float32)
    return float(np.abs(np.asarray(ours, np.float32) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask(flux/sd3)", "attention_mask"])
def test_matches_transformers_fp32(enc_case, masked):
    name, folder = enc_case
    ids, mask = _ids_and_mask()
    ref = t5_reference(folder, ids, mask if masked else None)
    enc = load_t5_encoder(folder)
    assert _stacked(enc) is (enc.config.num_layers >= 4)  # block 0 apart, the rest scanned when 3+
    out = jax.jit(enc.apply)(enc.params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask) if masked else None)
    assert out.shape == (3, 40, 32) and out.dtype == jnp.float32
    assert _rel_err(out, ref) <= FP32_REL_TOL, name
    if masked:  # the mask changes the padded rows (so it is applied, not ignored)
        assert _rel_err(out, t5_reference(folder, ids, None)) > 1e-3


def test_bf16_matches_transformers_bf16(enc_case):
    import torch

    name, folder = enc_case
    ids, _ = _ids_and_mask()
    enc = load_t5_encoder(folder, dtype=jnp.bfloat16)
    assert {v.dtype for v in jax.tree.leaves(enc.params)} == {jnp.dtype(jnp.bfloat16)}
    out = jax.jit(enc.apply)(enc.params, jnp.asarray(ids, jnp.int32))
    assert out.dtype == jnp.bfloat16 and bool(jnp.isfinite(out.astype(jnp.float32)).all())
    assert _rel_err(out, t5_reference(folder, ids, dtype=torch.bfloat16)) <= 0.04, name  # bf16: eps 2**-8
    assert _rel_err(out, t5_reference(folder, ids)) <= 0.04, name


def test_fp16_keeps_wo_in_fp32_and_clamps_like_transformers(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    folder = save_tiny_t5_encoder(tmp_path / "t5")
    ids, _ = _ids_and_mask()
    enc = load_t5_encoder(folder, dtype=jnp.float16)
    flat = {torch_key(p): v.dtype for p, v in nnx.to_flat_state(enc.params)}
    assert {k for k, d in flat.items() if d == jnp.float32} == {
        f"encoder.block.{i}.layer.1.DenseReluDense.wo.weight" for i in range(2)}
    out = jax.jit(enc.apply)(enc.params, jnp.asarray(ids, jnp.int32))
    assert out.dtype == jnp.float16
    assert _rel_err(out, t5_reference(folder, ids, dtype=torch.float16)) <= 0.01

    # Block 0's attention output past float16's range: transformers clamps the inf to 65504 - 1000
    # and carries on; without the clamp the RMSNorm would turn it into NaN.
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors["encoder.block.0.layer.0.SelfAttention.o.weight"] *= 3e4
    save_file(tensors, str(path), metadata={"format": "pt"})
    ref = t5_reference(folder, ids, dtype=torch.float16)
    assert np.isfinite(ref).all()
    hot = load_t5_encoder(folder, dtype=jnp.float16)
    out = np.asarray(jax.jit(hot.apply)(hot.params, jnp.asarray(ids, jnp.int32)), np.float32)
    assert np.isfinite(out).all() and _rel_err(out, ref) <= 0.02


def test_scanned_blocks_match_the_unrolled_ones_in_fp16(tmp_path, monkeypatch):
    """float16: block 0 (outside the scan) turns the residual stream float32 (``wo``), the scan
    carries it so; the same numbers as the unrolled blocks and transformers; unstack round-trips."""
    import torch
    from preheat.models.stacking import unstack

    folder = save_tiny_t5_encoder(tmp_path / "t5", num_layers=5)
    ids, mask = _ids_and_mask()

    def load(scan: bool):
        with monkeypatch.context() as m:
            m.setenv("PREHEAT_SCAN_MIN", "3" if scan else "off")
            return load_t5_encoder(folder, dtype=jnp.float16)

    flat, scanned = load(False), load(True)
    assert not _stacked(flat) and _stacked(scanned)
    run = lambda enc: np.asarray(jax.jit(enc.apply)(enc.params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask)),
                                 np.float32)
    got, want = run(scanned), run(flat)
    assert _rel_err(got, want) <= 1e-3
    assert _rel_err(got, t5_reference(folder, ids, mask, dtype=torch.float16)) <= 0.01
    back = {tuple(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(unstack(scanned.params))}
    assert back.keys() == {tuple(map(str, k)) for k, _ in nnx.to_flat_state(flat.params)}
    for k, v in nnx.to_flat_state(flat.params):
        np.testing.assert_array_equal(np.asarray(back[tuple(map(str, k))]), np.asarray(v.get_value()))


@pytest.mark.parametrize("buckets,distance,length", [(32, 128, 512), (8, 128, 300), (8, 20, 64), (16, 50, 700)])
def test_relative_position_buckets_match_transformers(buckets, distance, length):
    import torch
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    ref = T5Attention._relative_position_bucket(rel, bidirectional=True, num_buckets=buckets, max_distance=distance)
    ours = relative_position_buckets(length, buckets, distance)
    assert ours.dtype == np.int32 and ours.shape == (length, length)
    np.testing.assert_array_equal(ours, ref.numpy())  # integers: exact


def test_published_t5_xxl_maps_every_key_both_ways():
    """FLUX's / SD3's T5-XXL, built by transformers on the meta device (no memory), vs our abstract model."""
    import torch
    from transformers import T5Config as RefConfig, T5EncoderModel as Ref

    with torch.device("meta"):
        ref = Ref(RefConfig(**{k: v for k, v in T5_XXL.items() if k != "architectures"}))
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items() if k != "encoder.embed_tokens.weight"}
    config = T5Config.from_dict(T5_XXL)
    assert config.dense_act_fn == "gelu_new" and config.is_gated_act
    _, abstract = t5_mod.build_abstract(config)
    ours = {torch_key(p): expected_torch_shape(tuple(v.shape), str(p[-1])) for p, v in nnx.to_flat_state(abstract)}
    assert set(ours) - set(theirs) == set() and set(theirs) - set(ours) == set()
    assert ours == theirs and len(ours) == 24 * 9 + 3  # 9 tensors a block, + shared, bias, final norm
    assert ours["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] == (32, 64)
    assert sum(np.prod(s) for s in ours.values()) == sum(p.numel() for p in ref.parameters())  # 4.76 B


def test_checkpoint_layouts_tied_embedding_sharded_and_variant(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import T5EncoderModel as Ref

    folder = save_tiny_t5_encoder(tmp_path / "t5")
    ids, _ = _ids_and_mask()
    ref = t5_reference(folder, ids)
    tensors = load_file(str(folder / "model.safetensors"))

    def check(path, **kwargs):
        enc = load_t5_encoder(path, **kwargs)
        assert _rel_err(enc(ids), ref) <= FP32_REL_TOL

    # encoder.embed_tokens.weight instead of, or beside, shared.weight
    save_file({("encoder.embed_tokens.weight" if k == "shared.weight" else k): v for k, v in tensors.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    check(folder)
    both = tensors | {"encoder.embed_tokens.weight": tensors["shared.weight"].clone()}
    save_file(both, str(folder / "model.safetensors"), metadata={"format": "pt"})
    check(folder)
    # sharded (model.safetensors.index.json) and a variant
    sharded = tmp_path / "sharded"
    Ref.from_pretrained(str(folder)).save_pretrained(str(sharded), max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    check(sharded)
    (folder / "model.safetensors").rename(folder / "model.bf16.safetensors")
    check(folder, variant="bf16")
    with pytest.raises(ModelNotFoundError, match=r"has no model.safetensors"):
        load_t5_encoder(folder)
    # neither embedding key, or a wrong shape: one WeightsError listing the problem
    save_file({k: v for k, v in tensors.items() if k != "shared.weight"}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"missing shared.weight \(expected shape \(1000, 32\)\)") as info:
        load_t5_encoder(folder)
    assert "\n" not in str(info.value)
    bad = dict(tensors)
    wi_0 = "encoder.block.1.layer.1.DenseReluDense.wi_0.weight"
    bad[wi_0] = bad[wi_0][:5]
    save_file(bad, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"wi_0.weight has shape \(5, 32\), expected \(37, 32\)"):
        load_t5_encoder(folder)


@pytest.mark.parametrize("change,message", [
    ({"feed_forward_proj": "gated-swish"}, "unsupported feed_forward_proj 'gated-swish'"),
    ({"model_type": "umt5"}, "unsupported model_type 'umt5'"),
    ({"architectures": ["T5ForConditionalGeneration"]}, "unsupported architectures"),
    ({"is_decoder": True}, "unsupported is_decoder True"),
    ({"num_heads": 0}, "num_heads must be a positive integer"),
    ({"relative_attention_num_buckets": 2}, "relative_attention_num_buckets must be at least 4"),
])
def test_unsupported_config_is_refused_by_name(tmp_path, change, message):
    folder = save_tiny_t5_encoder(tmp_path / "t5", num_layers=1)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(UnsupportedConfigError, match=message) as info:
        load_t5_encoder(folder)
    assert "\n" not in str(info.value)


def test_config_and_bad_calls(tmp_path):
    config = T5Config.from_dict(T5_XXL)
    arch = config.architecture_dict()
    assert "pad_token_id" not in arch and "dropout_rate" not in arch
    assert arch["d_model"] == 4096 and arch["feed_forward_proj"] == "gated-gelu"
    with pytest.raises(ModelNotFoundError, match="text encoder folder .* does not exist"):
        load_t5_encoder(tmp_path / "nope")
    with pytest.raises(UnsupportedConfigError, match="unsupported dtype"):
        load_t5_encoder(tmp_path, dtype=jnp.int32)
    folder = save_tiny_t5_encoder(tmp_path / "t5", num_layers=1)
    enc = load_t5_encoder(folder)
    with pytest.raises(InvalidArgumentError, match=r"input_ids must be \(batch, length\)"):
        enc(np.zeros(5, np.int32))
    with pytest.raises(InvalidArgumentError, match="attention_mask has shape"):
        enc(np.zeros((2, 5), np.int32), np.ones((2, 4), np.int32))


def test_no_torch_or_transformers_at_run_time(tmp_path):
    """Tokenizing and encoding in a fresh process import neither torch nor transformers."""
    tok_dir = save_tiny_t5_tokenizer(tmp_path / "tok", layout="hub")
    enc_dir = save_tiny_t5_encoder(tmp_path / "enc", num_layers=1)
    code = (
        "import sys\n"
        "from preheat.models.t5_tokenizer import T5Tokenizer\n"
        "from preheat.models.t5 import load_t5_encoder\n"
        f"ids = T5Tokenizer.from_folder({str(tok_dir)!r}, max_length=16).encode(['a photo of a cat'])\n"
        f"out = load_t5_encoder({str(enc_dir)!r})(ids)\n"
        "assert out.shape == (1, 16, 32)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'sentencepiece'))\n"
        "assert not bad, bad\n"
    )
    src = str(__import__("preheat").__file__).rsplit("/preheat/", 1)[0]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": src, "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]


def test_prompts_to_embeddings_as_diffusers_flux_does(tmp_path):
    """FluxPipeline._get_t5_prompt_embeds: T5TokenizerFast then T5EncoderModel, no attention mask."""
    import torch
    from transformers import T5EncoderModel as Ref, T5TokenizerFast

    tok_dir = save_tiny_t5_tokenizer(tmp_path / "tokenizer_2", layout="hub")
    enc_dir = save_tiny_t5_encoder(tmp_path / "text_encoder_2")
    prompts = ["a photo of a cat", "", "an astronaut riding a horse on mars, oil painting"]
    ref_tok, ref_enc = T5TokenizerFast.from_pretrained(str(tok_dir)), Ref.from_pretrained(str(enc_dir)).eval()
    ids = ref_tok(prompts, padding="max_length", max_length=48, truncation=True, return_length=False,
                  return_overflowing_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = ref_enc(ids, output_hidden_states=False)[0].numpy()
    ours = load_t5_encoder(enc_dir)(T5Tokenizer.from_folder(tok_dir, max_length=48).encode(prompts))
    assert ours.shape == ref.shape == (3, 48, 32)
    assert _rel_err(ours, ref) <= FP32_REL_TOL


def test_offloaded_weights_are_read_from_host_memory_with_the_same_output(tmp_path):
    """``families.text.offload``: matrices and tables in pinned host memory, vectors on the device
    (``storage.offloaded_leaf``); the program that reads them gives the resident one's output exactly."""
    from preheat.families.text import offload

    folder = save_tiny_t5_encoder(tmp_path / "t5", num_layers=5)
    ids, _ = _ids_and_mask()
    enc = load_t5_encoder(folder)
    resident = jax.jit(enc.apply)(enc.params, jnp.asarray(ids, jnp.int32))
    offload(enc)
    kinds = {tuple(map(str, k)): v.get_value().sharding.memory_kind for k, v in nnx.to_flat_state(enc.params)}
    assert {kind for key, kind in kinds.items() if "layer_norm" in key} == {"device"}
    assert {kind for key, kind in kinds.items() if key[-2] in ("q", "wo", "embed_tokens")} == {"pinned_host"}
    out = jax.jit(enc.apply)(enc.params, jnp.asarray(ids, jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(resident))
    assert _rel_err(out, t5_reference(folder, ids)) <= FP32_REL_TOL


def test_on_a_v5e_offloaded_weights_stream_a_block_at_a_time(tmp_path):
    """Compiled for a v5e chip on this CPU (``warm --target``'s deviceless compile) from placeholders,
    as a prefetch traces it: the scan moves each block's matrices in from host memory as it reaches
    them (``storage.upcast`` under ``weights_from_host``), so the program's temporaries hold about one
    block, not the encoder's seven."""
    from preheat.cache.compile import on_device
    from preheat.families.text import _in_memory, offload
    from preheat.models.storage import weights_from_host
    from tests._support.tpu_fixtures import v5e_device

    device = v5e_device()
    folder = save_tiny_t5_encoder(tmp_path / "t5", num_layers=8, d_model=256, d_ff=2048, num_heads=4, d_kv=64)
    enc = load_t5_encoder(folder, dtype=jnp.bfloat16)
    offload(enc)
    placeholders = _in_memory(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), enc.params), "pinned_host")
    params = on_device(placeholders, device)
    ids = jax.ShapeDtypeStruct((1, 64), jnp.int32, sharding=jax.sharding.SingleDeviceSharding(device))

    def encode(params, ids):
        with weights_from_host():
            return enc.apply(params, ids)

    compiled = jax.jit(encode).lower(params, ids).compile()
    block = sum(v.nbytes for k, v in nnx.to_flat_state(enc.params) if "stacked" in map(str, k)) // 7  # blocks 1..7
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(enc.params))
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert weights > 8 * block and temp < 2 * block, (temp, block, weights)  # moved in whole it would be > 8 blocks
