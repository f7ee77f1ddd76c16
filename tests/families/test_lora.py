"""LoRAs as runtime data (issue 15): files made with peft on tiny SD 1.x, SD 2.x, SDXL, SD3 and Flux
folders, loaded by diffusers (``load_lora_weights``) as the reference; a kohya-named file converted
from the same tensors; zero retraces across LoRAs, scales and mixes; per-image adapters in one batch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import preheat
from preheat.cache.executables import Executables
from preheat.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError, PreheatError, WeightsError
from tests._support import flow_fixtures, sd_fixtures
from tests._support.lora_files import (TE_TARGETS, UNET_TARGETS, kohya_names, kohya_sgm_names, peft_layers,
                                        save_flux_lora, save_lora, scale_0)
from tests._support.numerics import mean_abs_px as _diff, px_diff

peft = pytest.importorskip("peft")


MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255
MISSING_WIDTH = 32  # tiny Flux: the width of a fused part a LoRA leaves out (2 heads x 16)


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    """Tiny SD 1.x, SD 2.x (linear proj_in, per-level heads, gelu text encoder, v-prediction) and
    SDXL folders, their LoRAs (A: UNet + text encoder, rank 4, alpha 8; B: UNet rank 8) and the
    kohya copy of SD's A; each kind built when a test first asks for it (SD 2.x's only in test-slow)."""
    base = tmp_path_factory.mktemp("lora")

    class Folders(dict):
        def __missing__(self, kind: str) -> dict:
            folder = sd_fixtures.save_tiny_sd(base / kind, kind=kind)
            ref = sd_fixtures.reference_pipeline(folder, "euler")
            te = "text_encoder_2" if kind == "sdxl" else "text_encoder"
            a = save_lora(ref, base / f"{kind}-A", "unet", {
                "unet": peft_layers(ref.unet, UNET_TARGETS, 4, 8, seed=1),
                te: peft_layers(getattr(ref, te), TE_TARGETS, 4, 4, seed=2)})
            b = save_lora(ref, base / f"{kind}-B", "unet", {
                "unet": peft_layers(ref.unet, ["to_k", "to_v", "ff.net.0.proj"], 8, 8, seed=3)})
            entry = self[kind] = {"folder": folder, "A": a, "B": b, "pipe": preheat.load(folder, cache="off")}
            if kind == "sd1":
                entry["kohya"] = kohya_names(a, base / "sd1-A-kohya.safetensors")
            return entry

    return Folders()


# diffusers' Flux layer -> (BFL name, its place in the fused layer, the fused layer's parts); by hand,
# from the original Flux code, so that the test does not share preheat's table
def _bfl_name(path: str) -> tuple[str, int, int] | None:
    parts = path.split(".")
    if parts[0] == "transformer_blocks":
        i, rest = parts[1], ".".join(parts[2:])
        qkv = {"attn.to_q": 0, "attn.to_k": 1, "attn.to_v": 2}
        add = {"attn.add_q_proj": 0, "attn.add_k_proj": 1, "attn.add_v_proj": 2}
        if rest in qkv:
            return f"double_blocks_{i}_img_attn_qkv", qkv[rest], 3
        if rest in add:
            return f"double_blocks_{i}_txt_attn_qkv", add[rest], 3
        one = {"attn.to_out.0": "img_attn_proj", "ff.net.2": "img_mlp_2", "norm1.linear": "img_mod_lin",
               "attn.to_add_out": "txt_attn_proj"}
        return f"double_blocks_{i}_{one[rest]}", 0, 1
    if parts[0] == "single_transformer_blocks":
        i, rest = parts[1], ".".join(parts[2:])
        lin1 = {"attn.to_q": 0, "attn.to_k": 1, "attn.to_v": 2, "proj_mlp": 3}
        if rest in lin1:
            return f"single_blocks_{i}_linear1", lin1[rest], 4
        return f"single_blocks_{i}_{ {'proj_out': 'linear2', 'norm.linear': 'modulation_lin'}[rest]}", 0, 1
    return {"x_embedder": ("img_in", 0, 1), "proj_out": ("final_layer_linear", 0, 1),
            "norm_out.linear": ("final_layer_adaLN_modulation_1", 0, 1)}[path]


def _flux_fused(src: Path, dst: Path, style: str) -> Path:
    """The transformer part of a diffusers Flux LoRA in BFL names (kohya "lora_unet_…", with alpha)
    or XLabs' (qkv and proj only, no alpha): q, k, v (and a single block's mlp) fused, A stacked,
    B block-diagonal -- the same update, at the summed rank."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(src), "np") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("transformer.")}
    scale = meta["transformer.lora_alpha"] / meta["transformer.r"]
    groups: dict[str, dict[int, tuple]] = {}
    sizes: dict[str, int] = {}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            path = key[len("transformer."):-len(".lora_A.weight")]
            name, place, count = _bfl_name(path)
            groups.setdefault(name, {})[place] = (tensors[key], tensors[key.replace("lora_A", "lora_B")], path)
            sizes[name] = count
    out = {}
    for name, members in groups.items():
        if style == "xlabs" and not any(t in name for t in ("attn_qkv", "attn_proj", "linear1", "linear2")):
            continue
        present = sorted(members)
        down = np.concatenate([members[j][0] for j in present])  # (sum of ranks, in)
        blocks = []
        for place in range(sizes[name]):  # B: one row block per part, its own columns only
            height = members[place][1].shape[0] if place in members else MISSING_WIDTH
            blocks.append(np.concatenate([members[j][1] if j == place else
                                          np.zeros((height, members[j][1].shape[1]), np.float32)
                                          for j in present], axis=1))
        up = np.concatenate(blocks)
        if name == "final_layer_adaLN_modulation_1":  # BFL keeps (shift, scale); diffusers (scale, shift)
            up = np.concatenate([up[up.shape[0] // 2:], up[:up.shape[0] // 2]])
        if style == "bfl":
            out[f"lora_unet_{name}.lora_down.weight"] = down
            out[f"lora_unet_{name}.lora_up.weight"] = up
            out[f"lora_unet_{name}.alpha"] = np.asarray(scale * down.shape[0], np.float32)
        else:
            i = name.split("_")[2]
            block = "double_blocks" if name.startswith("double") else "single_blocks"
            xl = {"img_attn_qkv": "qkv_lora1", "txt_attn_qkv": "qkv_lora2", "img_attn_proj": "proj_lora1",
                  "txt_attn_proj": "proj_lora2", "linear1": "qkv_lora", "linear2": "proj_lora"}
            kind = xl[name.split("_", 3)[3]]
            if kind == "qkv_lora" and block == "single_blocks":  # XLabs' single-block qkv has no mlp part
                down, up = down[: 3 * (down.shape[0] // 4)], up[: 3 * MISSING_WIDTH, : 3 * (down.shape[0] // 4)]
            out[f"{block}.{i}.processor.{kind}.down.weight"] = down
            out[f"{block}.{i}.processor.{kind}.up.weight"] = up * np.float32(scale)
    save_file(out, str(dst))
    return dst


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-flux")
    folder = flow_fixtures.save_tiny_flow_model(base / "flux-dev", "flux-dev")
    ref = flow_fixtures.reference_pipeline(folder)
    a = save_flux_lora(ref, base / "A", seed=4)
    return {"folder": folder, "A": a, "pipe": preheat.load(folder, cache="off"),
            "bfl": _flux_fused(a, base / "A-bfl.safetensors", "bfl"),
            "xlabs": _flux_fused(a, base / "A-xlabs.safetensors", "xlabs")}


def _noise(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4, 16, 16)).astype(np.float32)


def _fresh(pipe):
    """The same pipeline with an empty program table and a trace counter on its denoiser."""
    from preheat.lora import LoraRuntime

    fresh = dataclasses.replace(pipe, executables=Executables(), lora_runtime=LoraRuntime.of(pipe.components))
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
    pytest.param("sd2", "ddim", 0.8, dict(prompt="a photo of a cat", guidance_scale=7.5),  # v-prediction,
                 marks=pytest.mark.slow),  # linear proj_in, gelu encoder: test-slow
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
    plain = pipe.generate(prompt, noise=noise, steps=steps, sampler=sampler, guidance=guidance, **scale_0(entry["A"]))
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
    plain = pipe.generate("a watercolor fox", noise=noise, steps=steps, guidance=3.5, width=32, height=32,
                          **scale_0(flux["A"]))
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(ours, plain) > 5


def _transformer_only(src: Path, dst: Path) -> Path:
    """A diffusers Flux LoRA without its text-encoder part (what a BFL file can hold)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(src), "np") as f:
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("transformer.")}
    meta = {k: v for k, v in meta.items() if k.startswith("transformer.")}
    save_file(tensors, str(dst), metadata={"format": "pt", "lora_adapter_metadata": json.dumps(meta)})
    return dst


@pytest.mark.parametrize("style", ["bfl", "xlabs"])
def test_flux_bfl_and_xlabs_names_match_diffusers(flux, style, tmp_path, record_property):
    """XLabs files load in diffusers as they are; diffusers reads BFL-named files only at FLUX.1's
    full widths (3072), so the tiny BFL file is checked against the same tensors in diffusers' names."""
    noise, steps = _noise(1), 3
    ref = flow_fixtures.reference_pipeline(flux["folder"])
    file = flux[style] if style == "xlabs" else _transformer_only(flux["A"], tmp_path / "t.safetensors")
    ref.load_lora_weights(str(file))
    theirs = flow_fixtures.reference_pixels(ref, "a red fox", noise, num_inference_steps=steps, guidance_scale=3.5)
    pipe = flux["pipe"]
    ours = pipe.generate("a red fox", noise=noise, steps=steps, guidance=3.5, width=32, height=32, lora=flux[style])
    plain = pipe.generate("a red fox", noise=noise, steps=steps, guidance=3.5, width=32, height=32,
                          **scale_0(flux[style]))
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(ours, plain) > 2


# ------------------------------------------------------------------------------------ runtime data


def test_switching_loras_scales_and_mixes_never_retraces(sd):
    entry = sd["sd1"]
    pipe, traces = _fresh(entry["pipe"])
    call = dict(steps=2, seed=3, guidance=7.5)
    plain = pipe.generate("a photo of a cat", **call)
    a_half = pipe.generate("a photo of a cat", lora=entry["A"], lora_scale=0.5, **call)
    traced = len(traces)
    programs = len(pipe.executables)
    outs = [
        pipe.generate("a photo of a cat", lora=entry["A"], lora_scale=1.0, **call),
        pipe.generate("a photo of a cat", lora=entry["B"], **call),  # rank 8: the same bucket (16)
        pipe.generate("a photo of a cat", lora=[(entry["A"], 1.0), (entry["B"], 0.5)], **call),  # ranks 4 + 8
        pipe.generate("a photo of a cat", lora=entry["A"], lora_scale=0.0, **call),
    ]
    assert len(traces) == traced  # no retrace of the denoiser ...
    assert len(pipe.executables) == programs  # ... and no new program of any stage
    assert pipe.last.stages["denoise"].cache_layer == "memory"
    images = [plain, a_half, *outs[:3]]
    assert all(_diff(x, y) > 0.5 for i, x in enumerate(images) for y in images[i + 1:])  # each input mattered
    assert _diff(outs[3], plain) <= MEAN_TOL  # scale 0 through the LoRA program is the plain image
    np.testing.assert_array_equal(pipe.generate("a photo of a cat", **call), plain)  # no LoRA: the old program


def test_a_mixed_batch_gives_each_image_what_it_gives_alone(sd):
    entry = sd["sd1"]
    pipe = entry["pipe"]
    a, b = entry["A"], entry["B"]
    call = dict(steps=2, guidance=7.5)
    prompts, seeds = ["a photo of a cat", "a red fox", "city at night"], [11, 12, 13]
    loras = [a, None, [(a, 0.5), (b, 1.0)]]
    mixed = pipe.generate(prompts, lora=[[a], None, loras[2]], seed=seeds, **call)
    # each image alone, at batch 1: the one-slot and plain programs the module's batch-1 calls use
    # (no batch-3 program of its own); another batch size may round a pixel one level apart
    # (tests/test_engine.py), which the bound below already allows
    alone = [pipe.generate(prompts[i], seed=seeds[i], **call, **({} if loras[i] is None else {"lora": loras[i]}))[0]
             for i in range(3)]
    for i in range(3):
        assert px_diff(mixed[i], alone[i]).max() <= 1, i
    assert _diff(mixed[0], pipe.generate(prompts[0], seed=seeds[0], **call)[0]) > 5  # the LoRA mattered


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
        "unet.not_a_block.0.to_q.lora_A.weight": np.ones((4, 32)),
        "unet.not_a_block.0.to_q.lora_B.weight": np.ones((32, 4)),
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


def test_an_http_lora_is_pulled_once_then_served_offline(sd, tmp_path, monkeypatch):
    from tests._support.file_server import FileServer

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    entry = sd["sd1"]
    from preheat.lora import LoraRuntime

    pipe = dataclasses.replace(entry["pipe"], lora_runtime=LoraRuntime.of(entry["pipe"].components))
    call = dict(steps=2, seed=4, guidance=7.5)
    local = pipe.generate("a red fox", lora=entry["A"], **call)
    server = FileServer().start()
    try:
        server.files["/loras/a.safetensors"] = Path(entry["A"]).read_bytes()
        url = server.url("loras/a.safetensors")
        np.testing.assert_array_equal(pipe.generate("a red fox", lora=url, **call), local)
    finally:
        server.stop()
    pipe.lora_runtime.hold(max_loras=8)  # forget the parsed file: the weights store must serve it now
    np.testing.assert_array_equal(pipe.generate("a red fox", lora=(url, 1.0), **call), local)


def test_cli_lora_specs():
    from preheat.lora import parse_cli

    assert parse_cli("style.safetensors") == ("style.safetensors", 1.0)
    assert parse_cli("style.safetensors:0.8") == ("style.safetensors", 0.8)
    assert parse_cli("hf://org/repo/style.safetensors:-0.5") == ("hf://org/repo/style.safetensors", -0.5)
    assert parse_cli("http://host:8080/style.safetensors") == ("http://host:8080/style.safetensors", 1.0)
    with pytest.raises(InvalidArgumentError, match="finite"):
        parse_cli("style.safetensors:nan")


def test_cli_sample_takes_repeated_loras(sd, tmp_path):
    from click.testing import CliRunner
    from PIL import Image

    from preheat.cli import main

    entry = sd["sd1"]
    images = tmp_path / "images"
    result = CliRunner().invoke(main, ["sample", str(entry["folder"]), "--prompt", "a red fox", "--steps", "2",
                                       "--lora", f"{entry['A']}:0.5", "--lora", str(entry["B"]), "--cache", "off",
                                       "--out", str(tmp_path / "fox.png"), "--save-images", str(images)])
    assert result.exit_code == 0, result.output
    want = entry["pipe"].generate("a red fox", steps=2, seed=0, lora=[(entry["A"], 0.5), (entry["B"], 1.0)])
    np.testing.assert_array_equal(np.asarray(Image.open(images / "0000.png")), want[0])
    bad = CliRunner().invoke(main, ["sample", str(entry["folder"]), "--prompt", "x", "--lora", str(tmp_path / "no"),
                                    "--cache", "off", "--out", str(tmp_path / "bad.png")])
    assert bad.exit_code != 0 and "does not exist" in bad.output and len(bad.output.strip().splitlines()) == 1


def test_sdxl_kohya_original_layout_names_match_diffusers(sd, tmp_path, record_property):
    entry = sd["sdxl"]
    lora = kohya_sgm_names(entry["A"], tmp_path / "sgm.safetensors", layers=(1, 1))  # tiny SDXL: one layer per block
    noise, steps = _noise(1), 3
    ref = sd_fixtures.reference_pipeline(entry["folder"], "euler")
    ref.load_lora_weights(str(lora))
    theirs = sd_fixtures.reference_pixels(ref, "a photo of a dog", noise, num_inference_steps=steps, height=32,
                                          width=32, guidance_scale=5.0)
    pipe = entry["pipe"]
    ours = pipe.generate("a photo of a dog", noise=noise, steps=steps, sampler="euler", guidance=5.0, lora=lora)
    plain = pipe.generate("a photo of a dog", noise=noise, steps=steps, sampler="euler", guidance=5.0, **scale_0(lora))
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(ours, plain) > 2


SD3_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "ff.net.2", "norm1.linear"]


def test_sd3_lora_matches_diffusers(tmp_path_factory, record_property):
    """diffusers' SD3 LoRA names (``transformer.transformer_blocks.0.attn.to_q``) on the tiny SD3."""
    base = tmp_path_factory.mktemp("lora-sd3")
    folder = flow_fixtures.save_tiny_flow_model(base / "sd3", "sd3")
    ref = flow_fixtures.reference_pipeline(folder)
    a = save_lora(ref, base / "A", "transformer",
                  {"transformer": peft_layers(ref.transformer, SD3_TARGETS, 4, 8, seed=6)})
    noise = np.random.default_rng(0).standard_normal((1, ref.transformer.config.in_channels, 16, 16)).astype(np.float32)
    ref.load_lora_weights(str(a))
    theirs = flow_fixtures.reference_pixels(ref, "a watercolor fox", noise, num_inference_steps=3, guidance_scale=5.0,
                                            joint_attention_kwargs={"scale": 0.7})
    pipe = preheat.load(folder, cache="off")
    call = dict(noise=noise, steps=3, guidance=5.0, width=32, height=32)
    ours = pipe.generate("a watercolor fox", lora=a, lora_scale=0.7, **call)
    record_property("mean_abs_px", _diff(ours, theirs))
    assert _diff(ours, theirs) <= MEAN_TOL, _diff(ours, theirs)
    assert _diff(ours, pipe.generate("a watercolor fox", **call)) > 5


def test_lora_runtime_holds_the_run_time_state(tmp_path):
    """Pipeline.lora_runtime: files through one LRU, rank buckets run, warm-up zeros, one lock for all."""
    import threading

    from safetensors.numpy import save_file

    from preheat.families.components import PixelComponents
    from preheat.lora import LoraRuntime, LoraTargets

    targets = LoraTargets(family="toy", layers={"denoiser": {"blk.to_q": (4, 6)}, "text_encoder": {"q": (3, 5)}},
                          prefixes={"unet": "denoiser"}, path_prefix={})
    runtime = LoraRuntime(targets, ("text_encoder",))
    assert runtime.buckets == () and runtime.bucket_for(10) == 16
    runtime.compiled(64)
    assert runtime.buckets == (64,) and runtime.bucket_for(10) == 64 and runtime.bucket_for(100) == 128
    zeros = runtime.warm_zeros(16)
    assert runtime.warm_zeros(16) is zeros and set(zeros.layers) == {"denoiser", "text_encoder"}
    assert runtime.file(zeros) is zeros  # a file already read is used as it is
    path = tmp_path / "a.safetensors"
    save_file({"unet.blk.to_q.lora_A.weight": np.ones((2, 4), np.float32),
               "unet.blk.to_q.lora_B.weight": np.ones((6, 2), np.float32)}, str(path))
    first = runtime.file(str(path))
    assert runtime.file(str(path)) is first and (runtime.cache.hits, runtime.cache.misses) == (1, 1)
    cache = runtime.hold(max_loras=3, stack_slots=5)  # a server's --max-loras: a fresh LRU, what /metrics watches
    assert cache is runtime.cache and cache.max_size == 3 and len(cache) == 0 and runtime.stack_slots == 5
    assert runtime.file(str(path)) is not first and cache.misses == 1
    threads = [threading.Thread(target=runtime.compiled, args=(b,)) for b in (16, 32, 128) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert runtime.buckets == (16, 32, 64, 128)
    assert LoraRuntime.of(PixelComponents()) is None
