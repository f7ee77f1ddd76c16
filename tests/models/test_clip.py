"""Parity of preheat's JAX CLIP text encoders with transformers' torch CLIPTextModel(WithProjection)."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from preheat.errors import ModelNotFoundError, UnsupportedConfigError, WeightsError
from preheat.models import clip as clip_mod
from preheat.models.clip import CLIPTextConfig, load_clip_text
from preheat.models.weights import expected_torch_shape, torch_key
from tests._support.text_fixtures import clip_reference, save_tiny_clip, tiny_clip_config

FP32_TOL = 1e-4
EOS_ID = tiny_clip_config()["eos_token_id"]  # the tiny vocab's <|endoftext|>: its highest id, as CLIP's 49407
BOS_ID = tiny_clip_config()["bos_token_id"]

# (name, with_projection, hub_layout, config overrides)
CASES = [
    ("clip-l-like", False, True, dict(hidden_act="quick_gelu", eos_token_id=2, num_hidden_layers=2)),
    ("openclip-h-like", False, False, dict(hidden_act="gelu", eos_token_id=EOS_ID, num_hidden_layers=3)),
    ("bigg-like-proj", True, True, dict(hidden_act="gelu", eos_token_id=2, num_hidden_layers=5)),
    ("proj-quick-gelu", True, False, dict(hidden_act="quick_gelu", eos_token_id=EOS_ID, num_hidden_layers=2)),
]


def _prompts_ids(length: int = 77) -> np.ndarray:
    """Token rows as tokenizers make them, plus the edge cases of transformers' pooling rule."""
    rng = np.random.RandomState(0)
    ids = rng.randint(3, BOS_ID, size=(5, length))
    ids[:, 0] = BOS_ID
    ids[0, 5], ids[0, 6:] = EOS_ID, EOS_ID  # SD 1.x: padded with <|endoftext|> (first EOS wins)
    ids[1, 9], ids[1, 10:] = EOS_ID, 0  # SDXL tokenizer_2: padded with "!" (id 0)
    ids[2, -1] = EOS_ID  # over-long prompt, truncated: EOS last
    ids[3, 1], ids[3, 2:] = EOS_ID, EOS_ID  # the empty prompt
    # row 4 has no EOS: legacy takes argmax(ids), the new rule position 0 (both as transformers)
    return ids


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, tmp_path_factory):
    name, proj, hub, overrides = request.param
    folder = save_tiny_clip(tmp_path_factory.mktemp(name), with_projection=proj, hub_layout=hub, **overrides)
    return name, folder, proj


def _stacked(model) -> bool:
    return any("stacked" in map(str, k) for k, _ in nnx.to_flat_state(model.params))


def _err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


@pytest.mark.parametrize("length", [77, 16])
def test_matches_transformers_fp32(case, length):
    name, folder, proj = case
    ids = _prompts_ids(length)
    ref = clip_reference(folder, ids)
    model = load_clip_text(folder)
    assert model.config.with_projection is proj
    out = jax.jit(model.apply)(model.params, jnp.asarray(ids, jnp.int32))
    n_layers = model.config.num_hidden_layers
    assert _stacked(model) is (n_layers >= 3)  # 3+ layers: one scan (stacking.scan_min), its ys the states
    assert len(out.hidden_states) == len(ref["hidden_states"]) == n_layers + 1
    assert out.last_hidden_state.shape == (5, length, 32)
    assert _err(out.last_hidden_state, ref["last_hidden_state"]) <= FP32_TOL
    for i, (h, r) in enumerate(zip(out.hidden_states, ref["hidden_states"])):
        assert _err(h, r) <= FP32_TOL, f"{name}: hidden_states[{i}]"
    assert out.pooled.shape == (5, 32)
    assert _err(out.pooled, ref["pooled"]) <= FP32_TOL
    if proj:
        assert out.text_embeds.shape == (5, 24)
        assert _err(out.text_embeds, ref["text_embeds"]) <= FP32_TOL
    else:
        assert out.text_embeds is None and ref["text_embeds"] is None


def _load(folder, monkeypatch, scan: bool, **kw):
    with monkeypatch.context() as m:
        m.setenv("PREHEAT_SCAN_MIN", "3" if scan else "off")
        return load_clip_text(folder, **kw)


def test_scanned_layers_match_the_unrolled_ones_with_lora(tmp_path, monkeypatch):
    """The scan's per-layer outputs are the unrolled hidden_states; a LoRA reaches every scanned
    layer by its checkpoint path; unstack gives back the checkpoint's leaves."""
    from preheat.models.adapters import Adapters, targets
    from preheat.models.stacking import unstack

    folder = save_tiny_clip(tmp_path / "m", with_projection=True, hidden_act="gelu", num_hidden_layers=4)
    flat, scanned = _load(folder, monkeypatch, False), _load(folder, monkeypatch, True)
    assert not _stacked(flat) and _stacked(scanned)
    ids = jnp.asarray(_prompts_ids(), jnp.int32)
    layers = targets(flat.graphdef, flat.params)
    assert targets(scanned.graphdef, scanned.params) == layers  # per-layer paths, the checkpoint's
    k, r = 2, 4
    keys = iter(jax.random.split(jax.random.key(0), 2 * len(layers)))
    factors = {path: (jax.random.normal(next(keys), (k, cin, r)) * 0.1, jax.random.normal(next(keys), (k, r, cout)) * 0.1)
               for path, (cin, cout) in layers.items()}
    lora = Adapters(factors, jnp.ones((k, r)), jnp.array([0, 1, 0, 1, 1], jnp.int32))
    one = {p: (f[0] * 0, f[1] * 0) for p, f in factors.items()}
    one["text_model.encoder.layers.2.mlp.fc2"] = factors["text_model.encoder.layers.2.mlp.fc2"]
    lone = Adapters(one, lora.scales, lora.index)

    def run(model, adapters):
        return jax.jit(lambda p, lo: model.apply(p, ids, lora=lo))(model.params, adapters)

    base = run(flat, None)
    for adapters in (None, lora, lone):
        want, got = run(flat, adapters), run(scanned, adapters)
        assert len(got.hidden_states) == len(want.hidden_states) == 5
        for i, (g, w) in enumerate(zip(got.hidden_states, want.hidden_states)):
            assert _err(g, w) <= 2e-5, f"hidden_states[{i}]"
        assert _err(got.text_embeds, want.text_embeds) <= 2e-5
        if adapters is not None:  # the adapters (one scanned layer's alone) change the output
            assert _err(got.last_hidden_state, base.last_hidden_state) > 1e-4
    back = {tuple(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(unstack(scanned.params))}
    assert back.keys() == {tuple(map(str, k)) for k, _ in nnx.to_flat_state(flat.params)}
    for k, v in nnx.to_flat_state(flat.params):
        np.testing.assert_array_equal(np.asarray(back[tuple(map(str, k))]), np.asarray(v.get_value()))


def test_pooled_position_follows_the_eos_rule(tmp_path):
    """Legacy configs (eos_token_id 2) pool at argmax(ids); others at the first eos_token_id."""
    ids = _prompts_ids()
    ids[4, 0] = 3  # no BOS either, so the two rules pick different positions in row 4
    legacy_row4 = int(np.argmax(ids[4]))
    assert legacy_row4 != 0
    for eos, expected_row4 in ((2, legacy_row4), (EOS_ID, 0)):
        model = load_clip_text(save_tiny_clip(tmp_path / str(eos), eos_token_id=eos))
        out = model(ids)
        for row, pos in ((0, 5), (1, 9), (2, 76), (3, 1), (4, expected_row4)):
            np.testing.assert_array_equal(np.asarray(out.pooled[row]), np.asarray(out.last_hidden_state[row, pos]))


def test_clip_skip_is_diffusers_penultimate_with_final_norm(case):
    import torch
    import transformers

    _, folder, proj = case
    ids = _prompts_ids()
    model = load_clip_text(folder)
    out = model(ids)
    assert _err(model.clip_skip(model.params, out, 0), out.last_hidden_state) == 0.0
    ref_model = getattr(transformers, model.config.model_class).from_pretrained(str(folder)).eval()
    text_model = ref_model.text_model if proj else ref_model
    with torch.no_grad():
        hidden = ref_model(torch.as_tensor(ids), output_hidden_states=True).hidden_states
        ref = text_model.final_layer_norm(hidden[-2]).numpy()  # diffusers' clip_skip=1
    assert _err(model.clip_skip(model.params, out, 1), ref) <= FP32_TOL
    with pytest.raises(Exception, match="clip_skip"):
        model.clip_skip(model.params, out, len(out.hidden_states))
    # one skip per row, as data: row b gets hidden_states[-(skip[b] + 1)] through the norm
    skips = np.arange(len(ids)) % len(out.hidden_states)  # (B,)
    with torch.no_grad():
        per_row = np.stack([text_model.final_layer_norm(hidden[-(k + 1)][b]).numpy() for b, k in enumerate(skips)])
    assert _err(jax.jit(lambda o, s: model.clip_skip(model.params, o, s))(out, jnp.asarray(skips)), per_row) <= FP32_TOL
    sdxl = np.stack([hidden[-(k + 2) if k + 2 <= len(hidden) else -2][b].numpy() for b, k in enumerate(skips)])
    backs = np.asarray([k + 2 if k + 2 <= len(hidden) else 2 for k in skips])
    np.testing.assert_array_equal(np.asarray(clip_mod.hidden_state_from_end(out, jnp.asarray(backs))),
                                  np.asarray([out.hidden_states[-int(k)][b] for b, k in enumerate(backs)]))
    assert _err(clip_mod.hidden_state_from_end(out, jnp.asarray(backs)), sdxl) <= FP32_TOL


def test_bf16_runs_close_to_fp32_reference(tmp_path):
    """bf16 weights and activations (softmax and LayerNorm statistics in f32)."""
    folder = save_tiny_clip(tmp_path / "m", with_projection=True, hidden_act="gelu", num_hidden_layers=3)
    ids = _prompts_ids()
    ref = clip_reference(folder, ids)
    model = load_clip_text(folder, dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.bfloat16)}
    out = jax.jit(model.apply)(model.params, jnp.asarray(ids, jnp.int32))
    assert out.last_hidden_state.dtype == jnp.bfloat16
    # outputs are LayerNormed (magnitude ~1): bf16's 8-bit mantissa over 3 layers stays well inside 0.1
    assert _err(out.last_hidden_state, ref["last_hidden_state"]) < 0.1
    assert _err(out.text_embeds, ref["text_embeds"]) < 0.1


def test_weights_are_data_one_compile_serves_two_checkpoints(tmp_path):
    a = load_clip_text(save_tiny_clip(tmp_path / "a", seed=1))
    b = load_clip_text(save_tiny_clip(tmp_path / "b", seed=2))
    ids = jnp.asarray(_prompts_ids(), jnp.int32)
    forward = jax.jit(a.apply)
    out_a, out_b = forward(a.params, ids), forward(b.params, ids)
    assert forward._cache_size() == 1
    assert _err(out_a.last_hidden_state, out_b.last_hidden_state) > 1e-2
    assert _err(out_b.last_hidden_state, b(ids).last_hidden_state) <= 1e-5  # jit vs eager fusion


def test_fp16_variant_file(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = save_tiny_clip(tmp_path / "m", with_projection=True)
    full = load_clip_text(folder)
    tensors = {k: v.astype(np.float16) for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.fp16.safetensors"))
    (folder / "model.safetensors").unlink()
    half = load_clip_text(folder, variant="fp16")
    for x, y in zip(jax.tree.leaves(full.params), jax.tree.leaves(half.params)):
        np.testing.assert_array_equal(np.asarray(x).astype(np.float16).astype(np.float32), np.asarray(y))
    with pytest.raises(ModelNotFoundError, match="model.safetensors"):
        load_clip_text(folder)


# ----------------------------------------------------------------------------------------------
# Published configs at full size, by shape (transformers on torch's meta device: no memory)

_COMMON = dict(attention_dropout=0.0, bos_token_id=0, dropout=0.0, eos_token_id=2, initializer_factor=1.0,
               initializer_range=0.02, layer_norm_eps=1e-05, max_position_embeddings=77,
               model_type="clip_text_model", pad_token_id=1, torch_dtype="float32", vocab_size=49408)

# text_encoder/config.json of SD 1.5 and SDXL base (CLIP ViT-L/14), SD 2.1 (OpenCLIP ViT-H), and
# SDXL base's text_encoder_2/config.json (OpenCLIP ViT-bigG), as published.
CLIP_L = dict(_COMMON, architectures=["CLIPTextModel"], hidden_act="quick_gelu", hidden_size=768,
              intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12, projection_dim=768,
              transformers_version="4.22.0.dev0")
REAL_CONFIGS = {
    "sd15-text_encoder": CLIP_L,
    "sd21-text_encoder": dict(_COMMON, architectures=["CLIPTextModel"], hidden_act="gelu", hidden_size=1024,
                              intermediate_size=4096, num_attention_heads=16, num_hidden_layers=23,
                              projection_dim=512, torch_dtype="float16", transformers_version="4.25.0.dev0"),
    "sdxl-text_encoder": dict(CLIP_L, torch_dtype="float16", transformers_version="4.32.0.dev0"),
    "sdxl-text_encoder_2": dict(_COMMON, architectures=["CLIPTextModelWithProjection"], hidden_act="gelu",
                                hidden_size=1280, intermediate_size=5120, num_attention_heads=20,
                                num_hidden_layers=32, projection_dim=1280, torch_dtype="float16",
                                transformers_version="4.32.0.dev0"),
}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_published_config_maps_every_tensor_both_ways(name):
    import torch
    import transformers

    raw = REAL_CONFIGS[name]
    config = CLIPTextConfig.from_dict(raw)
    _, abstract = clip_mod.build_abstract(config)
    ours = {torch_key(path): expected_torch_shape(tuple(var.shape), str(path[-1]))
            for path, var in nnx.to_flat_state(abstract)}

    ref_config = transformers.CLIPTextConfig(**{k: v for k, v in raw.items() if k != "torch_dtype"})
    with torch.device("meta"):
        ref_model = getattr(transformers, raw["architectures"][0])(ref_config)
    theirs = {clip_mod.checkpoint_key(k): tuple(v.shape) for k, v in ref_model.state_dict().items()}

    assert sorted(set(theirs) - set(ours)) == []  # nothing transformers has is left unloaded
    assert sorted(set(ours) - set(theirs)) == []  # nothing we need is absent from its checkpoints
    wrong = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    assert wrong == {}
    assert len(ours) == 16 * raw["num_hidden_layers"] + 4 + (raw["architectures"][0].endswith("Projection"))


# ----------------------------------------------------------------------------------------------
# Config and folder errors


def test_config_reads_published_keys_and_architecture_dict():
    config = CLIPTextConfig.from_dict(REAL_CONFIGS["sdxl-text_encoder_2"])
    assert config.with_projection and config.hidden_act == "gelu" and config.eos_token_id == 2
    arch = config.architecture_dict()
    assert arch["model_class"] == "CLIPTextModelWithProjection" and arch["num_hidden_layers"] == 32
    assert "pad_token_id" not in arch and "bos_token_id" not in arch and "eos_token_id" in arch
    assert CLIPTextConfig.from_dict(CLIP_L).architecture_dict() != arch


@pytest.mark.parametrize("patch,match", [
    ({"hidden_act": "relu"}, r"unsupported hidden_act 'relu'.*'quick_gelu', 'gelu'"),
    ({"architectures": ["CLIPVisionModel"]}, r"unsupported model class 'CLIPVisionModel'.*'CLIPTextModel', "
                                             r"'CLIPTextModelWithProjection'"),
    ({"_class_name": "UNet2DModel"}, r"unsupported model class 'UNet2DModel'.*'CLIPTextModel'"),
    ({"model_type": "clip"}, r"unsupported model_type 'clip'"),
    ({"num_attention_heads": 5}, r"not divisible by num_attention_heads"),
    ({"eos_token_id": None}, r"eos_token_id must be an integer"),
])
def test_unsupported_config_is_one_line(tmp_path, patch, match):
    folder = save_tiny_clip(tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | patch))
    with pytest.raises(UnsupportedConfigError, match=match) as info:
        load_clip_text(folder)
    assert "\n" not in str(info.value)


def test_missing_folder_config_and_weights(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_clip_text(tmp_path / "nope")
    folder = save_tiny_clip(tmp_path / "m")
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    (folder / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_clip_text(folder)
    shutil.copy(tmp_path / "config.json", folder / "config.json")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="model.safetensors"):
        load_clip_text(folder)


def test_checkpoint_of_the_other_class_is_refused_by_tensor(tmp_path):
    folder = save_tiny_clip(tmp_path / "m", with_projection=True)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | {"architectures": ["CLIPTextModel"]}))
    with pytest.raises(WeightsError, match=r"unexpected text_projection.weight \(24, 32\)"):
        load_clip_text(folder)


def test_model_class_from_model_index_wins_over_architectures(tmp_path):
    folder = save_tiny_clip(tmp_path / "m", with_projection=True)
    raw = json.loads((folder / "config.json").read_text())
    del raw["architectures"]  # then the config alone says CLIPTextModel (transformers' default)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(WeightsError, match="unexpected text_projection.weight"):
        load_clip_text(folder)
    model = load_clip_text(folder, model_class="CLIPTextModelWithProjection")
    assert model.config.with_projection and model(_prompts_ids()).text_embeds.shape == (5, 24)
    with pytest.raises(UnsupportedConfigError, match="unsupported model class 'T5EncoderModel'"):
        load_clip_text(folder, model_class="T5EncoderModel")


def test_bad_input_ids_shape(tmp_path):
    model = load_clip_text(save_tiny_clip(tmp_path / "m", max_position_embeddings=20))
    with pytest.raises(Exception, match="max_position_embeddings 20"):
        model(np.zeros((1, 21), np.int32))
    with pytest.raises(Exception, match=r"\(batch, length\)"):
        model(np.zeros((21,), np.int32))


@pytest.mark.parametrize("pad,eos,proj", [("<|endoftext|>", 2, False), ("!", None, True)], ids=["sd", "sdxl-2"])
def test_tokenizer_output_feeds_the_encoder_like_diffusers(tmp_path, pad, eos, proj):
    """diffusers' encode_prompt: tokenizer(..., padding="max_length", truncation=True) -> text_encoder."""
    import torch
    import transformers

    from preheat.models.tokenizer import CLIPTokenizer
    from tests._support.text_fixtures import save_tiny_tokenizer

    tok_dir = save_tiny_tokenizer(tmp_path / "tok", pad_token=pad)
    overrides = {} if eos is None else {"eos_token_id": eos}
    enc_dir = save_tiny_clip(tmp_path / "enc", with_projection=proj, hidden_act="gelu", **overrides)
    prompts = ["an astronaut riding a horse on mars!", "", "watercolor fox, " * 30]
    ref_tok = transformers.CLIPTokenizer.from_pretrained(str(tok_dir))
    ref_ids = ref_tok(prompts, padding="max_length", max_length=ref_tok.model_max_length, truncation=True,
                      return_tensors="pt").input_ids
    ref_model = getattr(transformers, "CLIPTextModelWithProjection" if proj else "CLIPTextModel")
    ref_model = ref_model.from_pretrained(str(enc_dir)).eval()
    with torch.no_grad():
        ref = ref_model(ref_ids, output_hidden_states=True)

    with pytest.warns(UserWarning, match="truncated"):
        ids = CLIPTokenizer.from_folder(tok_dir).encode(prompts)
    model = load_clip_text(enc_dir)
    out = jax.jit(model.apply)(model.params, jnp.asarray(ids))
    assert ids.tolist() == ref_ids.tolist()
    assert _err(out.hidden_states[-2], ref.hidden_states[-2].numpy()) <= FP32_TOL  # SDXL's penultimate
    assert _err(out.last_hidden_state, ref.last_hidden_state.numpy()) <= FP32_TOL
    if proj:
        assert _err(out.text_embeds, ref.text_embeds.numpy()) <= FP32_TOL
    else:
        assert _err(out.pooled, ref.pooler_output.numpy()) <= FP32_TOL
