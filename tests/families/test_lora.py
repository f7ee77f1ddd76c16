"""LoRAs as runtime data (issue 15): files made with peft on tiny SD 1.x, SDXL and Flux folders,
loaded by diffusers (``load_lora_weights``) as the reference; a kohya-named file converted from the
same tensors; zero retraces across LoRAs, scales and mixes; per-image adapters in one batch."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError, PreheatError, WeightsError
from tests.families import flow_fixtures, sd_fixtures

peft = pytest.importorskip("peft")

MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2"]
FLUX_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "proj_mlp", "ff.net.2",
                "norm1.linear", "x_embedder"]
TE_TARGETS = ["q_proj", "v_proj", "fc1"]


def _peft_layers(module, targets: list[str], rank: int, alpha: float, seed: int) -> tuple[dict, dict]:
    """(peft state dict, adapter config) of a random LoRA on a copy of ``module``."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    model = inject_adapter_in_model(config, copy.deepcopy(module))
    with torch.no_grad():  # peft's non-default init is small; make the effect clearly visible
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(2.0)
    return get_peft_model_state_dict(model), config.to_dict()


def _save(pipe, directory: Path, denoiser: str, parts: dict[str, tuple[dict, dict]]) -> Path:
    """A diffusers LoRA file (``pytorch_lora_weights.safetensors``) with peft's metadata."""
    kwargs = {}
    for name, (layers, config) in parts.items():
        kwargs[f"{name}_lora_layers"] = layers
        kwargs[f"{name}_lora_adapter_metadata"] = config
    type(pipe).save_lora_weights(directory, **kwargs)
    return directory / "pytorch_lora_weights.safetensors"


def _kohya(src: Path, dst: Path) -> Path:
    """The same tensors under kohya / A1111 names (``lora_unet_…``, ``lora_te_…``, ``.alpha``)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(src), "np") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    out = {}
    for key, value in tensors.items():
        prefix, rest = key.split(".", 1)
        module, role = rest.rsplit(".lora_", 1)
        kohya = {"unet": "lora_unet", "text_encoder": "lora_te"}[prefix]
        if prefix == "text_encoder" and not module.startswith("text_model."):
            module = "text_model." + module
        name = f"{kohya}_{module}".replace(".", "_")
        out[f"{name}.lora_{'down' if role.startswith('A') else 'up'}.weight"] = value
        out[f"{name}.alpha"] = np.asarray(meta[f"{prefix}.lora_alpha"], np.float32)
    save_file(out, str(dst))
    return dst


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    """Tiny SD 1.x and SDXL folders, their LoRAs (A: UNet + text encoder, rank 4, alpha 8; B: UNet
    rank 8) and the kohya copy of SD's A."""
    base = tmp_path_factory.mktemp("lora")
    out = {}
    for kind in ("sd1", "sdxl"):
        folder = sd_fixtures.save_tiny_sd(base / kind, kind=kind)
        ref = sd_fixtures.reference_pipeline(folder, "euler")
        te = "text_encoder_2" if kind == "sdxl" else "text_encoder"
        a = _save(ref, base / f"{kind}-A", "unet", {
            "unet": _peft_layers(ref.unet, UNET_TARGETS, 4, 8, seed=1),
            te: _peft_layers(getattr(ref, te), TE_TARGETS, 4, 4, seed=2)})
        b = _save(ref, base / f"{kind}-B", "unet", {"unet": _peft_layers(ref.unet, ["to_k", "to_v", "ff.net.0.proj"],
                                                                         8, 8, seed=3)})
        out[kind] = {"folder": folder, "A": a, "B": b, "pipe": preheat.load(folder, cache="off")}
    out["sd1"]["kohya"] = _kohya(out["sd1"]["A"], base / "sd1-A-kohya.safetensors")
    return out


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-flux")
    folder = flow_fixtures.save_tiny_flow_model(base / "flux-dev", "flux-dev")
    ref = flow_fixtures.reference_pipeline(folder)
    a = _save(ref, base / "A", "transformer", {
        "transformer": _peft_layers(ref.transformer, FLUX_TARGETS, 4, 4, seed=4),
        "text_encoder": _peft_layers(ref.text_encoder, TE_TARGETS, 4, 8, seed=5)})
    return {"folder": folder, "A": a, "pipe": preheat.load(folder, cache="off")}


def _noise(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4, 16, 16)).astype(np.float32)


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int32) - b.astype(np.int32)).mean())


def _fresh(pipe):
    """The same pipeline with an empty program table and a trace counter on its denoiser."""
    fresh = dataclasses.replace(pipe, _executables={}, components=dict(pipe.components))
    fresh.components.pop("lora_buckets", None)
    traces = []
    apply = pipe.apply

    def counting(*args):
        traces.append(1)  # runs only while JAX traces the denoiser
        return apply(*args)

    fresh.apply = counting
    return fresh, traces


# ------------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("kind,sampler,scale,call", [
    ("sd1", "ddim", 0.8, dict(prompt="a photo of a cat", guidance_scale=7.5)),
    ("sdxl", "euler", 1.0, dict(prompt="a photo of a dog", guidance_scale=5.0)),
])
def test_sd_lora_matches_diffusers(sd, kind, sampler, scale, call, record_property):
    entry = sd[kind]
    noise, steps = _noise(1), 4
    ref = sd_fixtures.reference_pipeline(entry["folder"], sampler)
    ref.load_lora_weights(str(entry["A"]))
    prompt, guidance = call["prompt"], call["guidance_scale"]
    theirs = sd_fixtures.reference_pixels(ref, prompt, noise, num_inference_steps=steps, height=32, width=32,
                                          guidance_scale=guidance, cross_attention_kwargs={"scale": scale})
    pipe = entry["pipe"]
    ours = pipe.generate(prompt, noise=noise, steps=steps, sampler=sampler, guidance=guidance, lora=entry["A"],
                         lora_scale=scale)
    plain = pipe.generate(prompt, noise=noise, steps=steps, sampler=sampler, guidance=guidance)
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(ours, plain) > 5  # the LoRA really changes the image


def test_kohya_names_give_the_same_images(sd):
    entry = sd["sd1"]
    pipe = entry["pipe"]
    call = dict(steps=3, seed=5, guidance=6.0)
    peft_made = pipe.generate("a red fox", lora=entry["A"], lora_scale=0.7, **call)
    kohya = pipe.generate("a red fox", lora=entry["kohya"], lora_scale=0.7, **call)
    np.testing.assert_array_equal(peft_made, kohya)  # same factors, same alpha, same program


def test_flux_lora_matches_diffusers(flux, record_property):
    noise, steps, scale = _noise(1), 4, 0.7
    ref = flow_fixtures.reference_pipeline(flux["folder"])
    ref.load_lora_weights(str(flux["A"]))
    theirs = flow_fixtures.reference_pixels(ref, "a watercolor fox", noise, num_inference_steps=steps,
                                            guidance_scale=3.5, joint_attention_kwargs={"scale": scale})
    pipe = flux["pipe"]
    ours = pipe.generate("a watercolor fox", noise=noise, steps=steps, guidance=3.5, width=32, height=32,
                         lora=flux["A"], lora_scale=scale)
    plain = pipe.generate("a watercolor fox", noise=noise, steps=steps, guidance=3.5, width=32, height=32)
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(ours, plain) > 5


# ------------------------------------------------------------------------------------ runtime data


def test_switching_loras_scales_and_mixes_never_retraces(sd):
    entry = sd["sd1"]
    pipe, traces = _fresh(entry["pipe"])
    call = dict(steps=2, seed=3, guidance=7.5)
    plain = pipe.generate("a photo of a cat", **call)
    a_half = pipe.generate("a photo of a cat", lora=entry["A"], lora_scale=0.5, **call)
    traced = len(traces)
    programs = len(pipe._executables)
    outs = [
        pipe.generate("a photo of a cat", lora=entry["A"], lora_scale=1.0, **call),
        pipe.generate("a photo of a cat", lora=entry["B"], **call),  # rank 8: the same bucket (16)
        pipe.generate("a photo of a cat", lora=[(entry["A"], 1.0), (entry["B"], 0.5)], **call),  # ranks 4 + 8
        pipe.generate("a photo of a cat", lora=entry["A"], lora_scale=0.0, **call),
    ]
    assert len(traces) == traced  # no retrace of the denoiser ...
    assert len(pipe._executables) == programs  # ... and no new program of any stage
    assert pipe.last.stages["denoise"].cache_layer == "memory"
    images = [plain, a_half, *outs[:3]]
    assert all(_diff(x, y) > 0.5 for i, x in enumerate(images) for y in images[i + 1:])  # each input mattered
    assert _diff(outs[3], plain) <= MEAN_TOL  # scale 0 through the LoRA program is the plain image
    np.testing.assert_array_equal(pipe.generate("a photo of a cat", **call), plain)  # no LoRA: the old program


def test_a_mixed_batch_gives_each_image_what_it_gives_alone(sd):
    entry = sd["sd1"]
    pipe = entry["pipe"]
    a, b = entry["A"], entry["B"]
    call = dict(steps=2, seed=[11, 12, 13], guidance=7.5)
    prompts = ["a photo of a cat", "a red fox", "city at night"]
    mixed = pipe.generate(prompts, lora=[[a], None, [(a, 0.5), (b, 1.0)]], **call)
    alone = [pipe.generate(prompts, lora=a, **call)[0],
             pipe.generate(prompts, **call)[1],
             pipe.generate(prompts, lora=[(a, 0.5), (b, 1.0)], **call)[2]]
    for i in range(3):  # the same batch size, so the same per-image math
        assert np.abs(mixed[i].astype(np.int32) - alone[i].astype(np.int32)).max() <= 1, i
    assert _diff(mixed[0], pipe.generate(prompts, **call)[0]) > 5


def test_sdxl_text_encoder_2_lora_is_used(sd):
    entry = sd["sdxl"]
    pipe = entry["pipe"]
    request = pipe.validate("a photo of a dog", lora=entry["A"])
    (lora_file, _), = request.lora.slots[0]
    assert set(lora_file.layers) == {"denoiser", "text_encoder_2"}


# ------------------------------------------------------------------------------------ bad input


def _save_tensors(path: Path, tensors: dict) -> Path:
    from safetensors.numpy import save_file

    save_file({k: np.asarray(v, np.float32) for k, v in tensors.items()}, str(path))
    return path


def test_bad_input_is_one_line(sd, tmp_path):
    entry = sd["sd1"]
    pipe = entry["pipe"]
    layer = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    unknown = _save_tensors(tmp_path / "unknown.safetensors", {
        "unet.not_a_block.0.to_q.lora_A.weight": np.ones((4, 32)), "unet.not_a_block.0.to_q.lora_B.weight": np.ones((32, 4)),
        f"{layer}.lora_A.weight": np.ones((4, 32)), f"{layer}.lora_B.weight": np.ones((32, 4))})
    wide = _save_tensors(tmp_path / "wide.safetensors", {f"{layer}.lora_A.weight": np.ones((130, 32)),
                                                         f"{layer}.lora_B.weight": np.ones((32, 130))})
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(Path(entry["A"]).read_bytes()[:-100])
    cases = [
        (dict(lora=unknown), WeightsError, "not_a_block"),
        (dict(lora=wide), InvalidArgumentError, "16, 32, 64, 128"),
        (dict(lora=corrupt), ModelFormatError, "corrupt.safetensors"),
        (dict(lora=entry["A"], lora_scale=float("nan")), InvalidArgumentError, "finite"),
        (dict(lora=[(entry["A"], float("inf"))]), InvalidArgumentError, "finite"),
        (dict(lora=tmp_path / "missing.safetensors"), ModelNotFoundError, "does not exist"),
        (dict(lora_scale=0.5), InvalidArgumentError, "no lora"),
    ]
    for kwargs, exc, needle in cases:
        with pytest.raises(exc) as info:
            pipe.generate("a photo of a cat", steps=1, **kwargs)
        message = str(info.value)
        assert needle in message and "\n" not in message, message
    assert pipe.generate("a photo of a cat", steps=1, lora=entry["A"]).shape == (1, 32, 32, 3)  # still serving


def test_models_without_lora_support_refuse_it(sd):
    pipe = preheat.load(None, cache="off")  # the built-in pixel model
    with pytest.raises(PreheatError, match="not supported"):
        pipe.generate(1, steps=1, lora=sd["sd1"]["A"])
