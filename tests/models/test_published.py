"""Inferring the published model of a single file without ``config=`` (issue 28 item 1), and the
published configs preheat ships for it (``preheat/assets/single_file_configs``).

Tiny random files cannot have the published shapes, so inference is tested on abstract key/shape
tables: every shipped config is built by diffusers' (or transformers') own model class on torch's
meta device (no memory), and its state dict's shapes are written back in the original layout by
the tests' inverse tables (``ldm_files.to_original`` for LDM/SGM, ``bfl_files.to_bfl``
for FLUX.1). SD3's original MMDiT layout has no inverse table here: the names inference reads are
derived from diffusers' module shapes by hand (``_mmdit_names``).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np
import pytest

import preheat
from preheat.errors import FetchError, InvalidArgumentError, ModelFormatError
from preheat.models.published import CONFIGS, PUBLISHED, config_folder, infer, infer_file, named
from tests._support.bfl_files import to_bfl
from tests._support.ldm_files import to_original

NAMES = [p.name for p in PUBLISHED]
KIND = {"stable-diffusion-v1-5": "sd1", "stable-diffusion-2-1": "sd2", "stable-diffusion-2-1-base": "sd2",
        "stable-diffusion-xl-base-1.0": "sdxl", "stable-diffusion-xl-refiner-1.0": "sdxl-refiner"}
SAME_TENSORS = {"stable-diffusion-2-1-base": "stable-diffusion-2-1"}  # told apart by name only (docs/models.md)


class Abstract:
    """A tensor's shape and dtype only: what the inverse tables slice, transpose, split and stack."""

    def __init__(self, shape, dtype=np.float32):
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def T(self) -> "Abstract":
        return Abstract(self.shape[::-1], self.dtype)

    def _view(self) -> np.ndarray:  # zero strides: no memory, whatever the shape
        return np.broadcast_to(np.zeros((), np.int8), self.shape)

    def __getitem__(self, index) -> "Abstract":
        return Abstract(self._view()[index].shape, self.dtype)

    def __array_function__(self, func, types, args, kwargs):
        if func is np.concatenate:
            parts, axis = args[0], kwargs.get("axis", 0)
            first = list(parts[0].shape)
            first[axis] = sum(p.shape[axis] for p in parts)
            return Abstract(first, parts[0].dtype)
        if func is np.split:
            return [Abstract(v.shape, self.dtype) for v in np.split(self._view(), *args[1:], **kwargs)]
        if func is np.ascontiguousarray:
            return self
        return NotImplemented


def _config(name: str, component: str) -> dict:
    folder = config_folder(next(p for p in PUBLISHED if p.name == name)) / component
    return json.loads(next(folder.glob("*.json")).read_text())


def _meta_state(name: str, component: str) -> dict[str, Abstract]:
    """A shipped component built on the meta device by its own library: {name: Abstract}."""
    return _built(json.dumps(_config(name, component), sort_keys=True))


@functools.lru_cache(maxsize=None)
def _built(text: str) -> dict[str, Abstract]:  # the encoders several models share are built once
    import diffusers
    import torch
    import transformers

    config = json.loads(text)
    with torch.device("meta"):
        if "_class_name" in config:
            model = getattr(diffusers, config["_class_name"]).from_config(config)
        else:
            cls = getattr(transformers, config["architectures"][0])
            model = cls(cls.config_class.from_dict(config))
    return {k: Abstract(v.shape) for k, v in model.state_dict().items()}


def _mmdit_names(state: dict[str, Abstract], config: dict) -> dict[str, tuple[int, ...]]:
    """The SD3 original names inference reads: the patch embedding, the position table, each block's
    fused q/k/v and context modulation (and SD3.5 medium's second attention)."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    out = {"x_embedder.proj.weight": state["pos_embed.proj.weight"].shape,
           "pos_embed": (1, config["pos_embed_max_size"] ** 2, width)}
    for key, value in state.items():
        if m := re.match(r"transformer_blocks\.(\d+)\.(attn2?)\.to_q\.weight$", key):
            out[f"joint_blocks.{m[1]}.x_block.{m[2]}.qkv.weight"] = (3 * value.shape[0], value.shape[1])
        elif m := re.match(r"transformer_blocks\.(\d+)\.norm1_context\.linear\.weight$", key):
            out[f"joint_blocks.{m[1]}.context_block.adaLN_modulation.1.weight"] = value.shape
    return out


def _original_shapes(name: str, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """{original name: shape} of the published model ``name``, as its single file holds it."""
    published = next(p for p in PUBLISHED if p.name == name)
    if published.layout in ("ldm", "sgm", "sgm-refiner"):
        def load(path):
            return _meta_state(name, str(path).split("/")[-2])
        return {k: v.shape for k, v in to_original(config_folder(published), KIND[name], load).items()}
    state = _meta_state(name, "transformer")
    if published.layout == "bfl":
        return {k: v.shape for k, v in to_bfl(state, prefix).items()}
    return {prefix + k: v for k, v in _mmdit_names(state, _config(name, "transformer")).items()}


@pytest.mark.parametrize("name", NAMES)
def test_every_published_model_is_told_apart_by_its_shapes(name):
    shapes = _original_shapes(name)
    assert infer(shapes).name == SAME_TENSORS.get(name, name)
    assert named(name).fits(shapes)  # config=<its name> reads the file as that model
    if not name.startswith("stable-diffusion-") or "3" in name:  # transformers: ComfyUI's prefix too
        assert infer(_original_shapes(name, "model.diffusion_model.")).name == name


def test_a_file_of_no_published_model_names_every_model_tried(tmp_path):
    shapes = _original_shapes("stable-diffusion-v1-5")
    inpainting = {**shapes, "model.diffusion_model.input_blocks.0.0.weight": (320, 9, 3, 3)}  # 9 input channels
    with pytest.raises(ModelFormatError) as err:
        infer(inpainting, "sd15-inpainting.safetensors")
    message = str(err.value)
    assert "\n" not in message and message.startswith("sd15-inpainting.safetensors: cannot tell which published model")
    for published in PUBLISHED:
        assert published.title in message
    assert "its keys start cond_stage_model." in message and "pass config=" in message


def test_the_sdxl_refiner_is_told_from_the_base_by_its_embedder_and_unet():
    """The refiner's file (OpenCLIP bigG alone, as embedder 0; a 384-channel UNet whose label_emb
    takes 2560) is its own layout and model, never the base's nor the base's its; a file holding
    both models' text embedders is neither: one line naming both."""
    from preheat.models.single_file import detect_layout

    refiner = _original_shapes("stable-diffusion-xl-refiner-1.0")
    base = _original_shapes("stable-diffusion-xl-base-1.0")
    assert detect_layout(list(refiner), Path("refiner.safetensors")).name == "sgm-refiner"
    assert detect_layout(list(base), Path("base.safetensors")).name == "sgm"
    assert not named("stable-diffusion-xl-base-1.0").fits(refiner)
    assert not named("stable-diffusion-xl-refiner-1.0").fits(base)
    both = {**refiner, **{k: v for k, v in base.items() if k.startswith("conditioner.embedders.1.")}}
    with pytest.raises(ModelFormatError) as err:
        infer(both, "both.safetensors")
    message = str(err.value)
    assert "\n" not in message and message.startswith("both.safetensors: cannot tell which published model")
    assert ("SDXL base 1.0 (SGM, conditioner.embedders.1.model.*, label_emb (1280, 2816)); SDXL refiner 1.0 (SGM, "
            "conditioner.embedders.0.model.* alone, label_emb (1536, 2560))") in message


def test_load_without_config_names_the_inferred_model(tmp_path, monkeypatch):
    """A file with FLUX.1 dev's names and shapes (only the ones inference reads: small), offline: one
    line naming the model, the folders it lacks, its published repository and config=, before
    anything is converted (tests/models/test_published_fetch.py fetches them from a stand-in Hub)."""
    from safetensors.numpy import save_file

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shapes = _original_shapes("FLUX.1-dev")
    read = ["img_in.weight", "guidance_in.in_layer.weight"]
    read += [k for k in shapes if re.match(r"(double|single)_blocks\.\d+\.linear2?\.bias$|double_blocks\.\d+\.img_mlp\.0\.bias$", k)]
    path = tmp_path / "flux1-dev.safetensors"
    save_file({k: np.zeros(shapes[k], np.float16) for k in read}, str(path))
    assert infer_file(path).name == "FLUX.1-dev"
    with pytest.raises(FetchError, match=r"is a FLUX\.1 dev single file; it needs text_encoder/, text_encoder_2/, "
                                         r"tokenizer/, tokenizer_2/, vae/ from hf://black-forest-labs/FLUX\.1-dev, .*"
                                         r"HF_HUB_OFFLINE is set.*; or pass config=<a folder holding text_encoder/, "
                                         r"text_encoder_2/, tokenizer/, tokenizer_2/, vae/, or a FLUX\.1 dev diffusers "
                                         r"folder, e\.g\. hf://black-forest-labs/FLUX\.1-dev>$") as err:
        preheat.load(path, cache="off")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "home" / "models" / "single").exists()  # nothing converted


def test_a_comfyui_bundle_needs_only_the_tokenizers(tmp_path):
    """FLUX.1 dev's transformer (the names inference reads) bundled as ComfyUI ships it, with a VAE
    under ``vae.`` and CLIP-L and T5 under ``text_encoders.``: a tokenizers-only ``config=`` folder
    is enough (the shipped configs go beside it); the transformer alone is still refused, naming
    the components it lacks."""
    from safetensors.numpy import save_file

    from preheat.models.published import needed, with_components

    shapes = _original_shapes("FLUX.1-dev", "model.diffusion_model.")
    read = [k for k in shapes if re.match(r"model\.diffusion_model\.(img_in\.weight|guidance_in\.in_layer\.weight|"
                                          r"(double|single)_blocks\.\d+\.linear2?\.bias|double_blocks\.\d+\.img_mlp\.0\.bias)$", k)]
    transformer = {k: np.zeros(shapes[k], np.float16) for k in read}
    bundled = {"vae.decoder.conv_in.weight": np.zeros((1,), np.float16),
               "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight": np.zeros((1,), np.float16),
               "text_encoders.t5xxl.transformer.shared.weight": np.zeros((1,), np.float16)}
    tokenizers = tmp_path / "tokenizers"
    for name in ("tokenizer", "tokenizer_2"):
        (tokenizers / name).mkdir(parents=True)
        (tokenizers / name / "vocab.json").write_text("{}")
    alone, bundle = tmp_path / "flux1-dev.safetensors", tmp_path / "flux1-dev-comfy.safetensors"
    save_file(transformer, str(alone))
    save_file({**transformer, **bundled}, str(bundle))
    with pytest.raises(InvalidArgumentError, match=r"\(bfl layout\) without the weights of text_encoder, "
                                                   r"text_encoder_2, vae"):
        with_components(alone, tokenizers, tmp_path / "root", needed(alone))
    assert needed(bundle).components == ("tokenizer", "tokenizer_2")
    folder = with_components(bundle, tokenizers, tmp_path / "root", needed(bundle))
    assert (folder / "transformer" / "config.json").is_file() and (folder / "tokenizer_2" / "vocab.json").is_file()


@pytest.mark.parametrize("name", NAMES)
def test_the_shipped_configs_load_into_their_classes(name):
    """Every component config names only its class's own fields and builds it (meta device); every
    component model_index.json names has a config, except the tokenizers and the safety checker."""
    import diffusers
    import transformers

    folder = CONFIGS / name
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] in ("StableDiffusionPipeline", "StableDiffusionXLPipeline",
                                    "StableDiffusionXLImg2ImgPipeline", "StableDiffusion3Pipeline", "FluxPipeline")
    for component, entry in index.items():
        if component.startswith("_") or not isinstance(entry, list) or None in entry:
            continue
        if component.startswith(("tokenizer", "feature_extractor", "safety_checker")):
            assert not (folder / component).exists()  # not shipped (too large, or not used)
            continue
        config = _config(name, component)
        if component == "scheduler":
            cls = getattr(diffusers, entry[1])
            assert config["_class_name"] == entry[1]
            _, unused, _ = cls.extract_init_dict(config)
            assert not {k for k in unused if not k.startswith("_")}, (component, unused)
            cls.from_config(config)
            continue
        if entry[0] == "diffusers":
            cls = getattr(diffusers, entry[1])
            assert config["_class_name"] == entry[1]
            _, unused, _ = cls.extract_init_dict(config)
            assert not {k for k in unused if not k.startswith("_")}, (component, unused)
        else:
            cls = getattr(transformers, entry[1])
            assert config["architectures"] == [entry[1]]
            known = set(cls.config_class().to_dict())
            # what the published files carry from the transformers versions that wrote them
            older = {"architectures", "torch_dtype", "dropout", "output_past", "decoder_start_token_id"}
            assert set(config) - known <= older, (component, set(config) - known)
        assert len(_meta_state(name, component)) > 10


def test_config_may_be_a_folder_of_tokenizers_only(tmp_path, monkeypatch):
    """``config=`` a folder holding only ``tokenizer/``: the shipped configs of the inferred model
    are used with it. Tiny files are no published model, so a tiny SD 1.x stands in for one (its
    configs shipped in a stand-in assets folder); it loads, and converts to the very files the whole
    folder as config= gives."""
    import shutil

    from safetensors.numpy import save_file

    from preheat.models import published as module
    from tests._support.sd_fixtures import save_tiny_sd

    folder = save_tiny_sd(tmp_path / "sd1", kind="sd1")
    path = tmp_path / "tiny-sd1.safetensors"
    save_file(to_original(folder, "sd1"), str(path))
    assets = tmp_path / "assets"
    shutil.copytree(folder, assets / "tiny-sd1", ignore=shutil.ignore_patterns("*.safetensors", "tokenizer"))
    tiny = module.Published("tiny-sd1", "tiny SD 1.x", "example/tiny-sd1", "ldm", "any file", lambda shapes: True)
    monkeypatch.setattr(module, "CONFIGS", assets)
    monkeypatch.setattr(module, "PUBLISHED", (tiny,))
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    tokenizers = tmp_path / "tokenizers"
    shutil.copytree(folder / "tokenizer", tokenizers / "tokenizer")

    pipe = preheat.load(path, config=tokenizers, cache="off")  # loads (not sampled: the same files as below)
    assert pipe.family.name == "stable-diffusion"
    from preheat.files import MADE_FROM  # what it was made from (preheat.store.collect_orphans)

    (made,) = (tmp_path / "home" / "models" / "single-configs").iterdir()
    assert sorted(p.name for p in made.iterdir() if p.name != MADE_FROM) == sorted(p.name for p in folder.iterdir())
    # the same converted folder as with the whole folder as config= (whose image test_single_file checks)
    from preheat.models.single_file import materialize

    (ours,) = (tmp_path / "home" / "models" / "single").iterdir()
    theirs = materialize(path, folder, tmp_path / "other")
    for part in ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                 "text_encoder/model.safetensors", "tokenizer/vocab.json", "scheduler/scheduler_config.json"):
        assert (ours / part).read_bytes() == (theirs / part).read_bytes(), part

    with pytest.raises(InvalidArgumentError, match=r"is a tiny SD 1\.x single file; config=.* has no tokenizer/: "
                                                   r"pass a folder with tokenizer/, or a tiny SD 1\.x diffusers folder, "
                                                   r"e\.g\. hf://example/tiny-sd1") as err:
        preheat.load(path, config=tmp_path / "assets", cache="off")
    assert err.value.argument == "config" and "\n" not in str(err.value)

    # the tokenizer folder edited: another config folder and conversion; the old pair is stale and goes
    # in one prune (the conversion with the config folder it was read with)
    import os
    import time

    from preheat.store import collect_orphans, derived_folders

    config = tokenizers / "tokenizer" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 77}))
    preheat.load(path, config=tokenizers, cache="off")
    old_configs, old_single = made.relative_to(made.parents[1]).as_posix(), ours.relative_to(ours.parents[1]).as_posix()
    later = time.time() + 7200
    states = {d.name: (d.state, d.why) for d in derived_folders(tmp_path / "home", now=later)}
    assert len(states) == 4 and [s for s, _ in states.values()].count("live") == 2, states
    assert states[old_configs][0] == "changed-source", states
    assert states[old_configs][1].startswith(f"its config file {config.resolve()} changed since it was made (sha256 ")
    assert states[old_single] == ("dead", f"made from {old_configs}, which goes too: no load reaches it"), states
    assert sorted(collect_orphans(tmp_path / "home", now=later)) == sorted([old_single, old_configs])
    assert not made.exists() and not ours.exists() and len(os.listdir(tmp_path / "home" / "models" / "single")) == 1


def test_sd2_base_is_the_768_model_but_for_its_scheduler_and_sizes():
    """SD 2.1 base's shipped configs are SD 2.1's but for what makes it the 512 px epsilon model:
    its scheduler (PNDM, epsilon), the UNet's sample size and fp32 attention (upcast only in the
    768 px model); the VAE's config is the same (its sample_size 768 too, as published); its
    published repository by each spelling ``config=`` takes."""
    def configs(name):
        folder = CONFIGS / name
        return {p.relative_to(folder).as_posix(): json.loads(p.read_text()) for p in folder.rglob("*.json")}

    v, base = configs("stable-diffusion-2-1"), configs("stable-diffusion-2-1-base")
    assert sorted(v) == sorted(base)
    changed = {(f, k): (v[f].get(k), base[f].get(k)) for f in v for k in set(v[f]) | set(base[f]) if v[f].get(k) != base[f].get(k)}
    assert changed == {("model_index.json", "scheduler"): (["diffusers", "DDIMScheduler"], ["diffusers", "PNDMScheduler"]),
                       ("scheduler/scheduler_config.json", "_class_name"): ("DDIMScheduler", "PNDMScheduler"),
                       ("scheduler/scheduler_config.json", "prediction_type"): ("v_prediction", "epsilon"),
                       ("unet/config.json", "sample_size"): (96, 64), ("unet/config.json", "upcast_attention"): (True, False)}
    for spelling in ("stable-diffusion-2-1-base", "stabilityai/stable-diffusion-2-1-base",
                     "hf://stabilityai/stable-diffusion-2-1-base"):
        assert named(spelling).name == "stable-diffusion-2-1-base"
    assert named("hf://stabilityai/stable-diffusion-2-1").name == "stable-diffusion-2-1" and named("./sd2") is None
