"""Single-file checkpoints (issue 28 item 1): tiny SD 1.x, SD 2.x and SDXL folders written back in
the original LDM layout (``model.diffusion_model.*``, ``first_stage_model.*``, SD 1.x's
``cond_stage_model.transformer.*`` or SD 2.x's OpenCLIP ``cond_stage_model.model.*``) and SGM layout
(the same UNet and VAE plus ``conditioner.embedders.0/1.*``; the SDXL refiner's OpenCLIP bigG alone as
``conditioner.embedders.0.model.*``), and a tiny FLUX.1-dev transformer in
BFL's layout (``double_blocks.*``, ...); diffusers' own ``from_single_file(path, config=folder)``
loads that file to the folder's image or weights (so the file is real), and ``preheat.load(path,
config=folder)`` gives diffusers' image from the folder."""

from __future__ import annotations

import re

import numpy as np
import pytest

import preheat
from preheat.errors import ModelFormatError, ModelNotFoundError, WeightsError
from tests._support import flow_fixtures, image_fixtures
from tests._support.bfl_files import to_bfl
from tests._support.ldm_files import to_original
from tests._support.numerics import mean_abs_px
from tests._support.sd_fixtures import reference_pipeline, reference_pixels, save_tiny_sd
from tests._support.single_files import diffusers_bfl_at_tiny_widths


MEAN_TOL = 1.0  # mean |pixel difference| <= 1 level of 255


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{kind: (folder, single file)}: SD 1.x and SD 2.x in the LDM layout, SDXL in the SGM layout."""
    from safetensors.numpy import save_file

    base = tmp_path_factory.mktemp("single")
    out = {}
    for kind, layout in (("sd1", "ldm"), ("sd2", "ldm"), ("sdxl", "sgm")):
        folder = save_tiny_sd(base / kind, kind=kind)
        path = base / f"tiny-{kind}-{layout}.safetensors"
        save_file(to_original(folder, kind), str(path))
        out[kind] = (folder, path)
    return out


@pytest.fixture
def single(files):
    return files["sd1"]


def _diffusers_open_clip(folder, path):
    """SDXL's second text encoder, read from the file by diffusers' own OpenCLIP conversion.

    ``from_single_file`` tells SDXL's two embedders apart by their widths alone; the tiny folder's
    are both 16 wide, so it would read embedder 0 twice. Its conversion of embedder 1 is called
    directly instead, on the same file."""
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint
    from safetensors.torch import load_file
    from transformers import CLIPTextModelWithProjection

    model = CLIPTextModelWithProjection.from_pretrained(folder / "text_encoder_2")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_open_clip_checkpoint(model, load_file(str(path)), prefix="conditioner.embedders.1.model.")
    assert sorted(converted) == sorted(k for k in expected if not k.endswith("position_ids"))
    model.load_state_dict(converted, strict=False)
    assert all(torch_equal(model.state_dict()[k], expected[k]) for k in converted)  # the file holds the folder's
    return model


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _noise() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((1, 4, 16, 16)).astype(np.float32)


@pytest.mark.parametrize("kind", ["sd1", "sd2", "sdxl"])
def test_single_file_matches_the_folder_it_was_converted_from(files, kind, tmp_path, monkeypatch, record_property):
    import torch
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    folder, path = files[kind]
    cls = StableDiffusionXLPipeline if kind == "sdxl" else StableDiffusionPipeline
    sampler = "euler" if kind == "sdxl" else "ddim"
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    call = dict(num_inference_steps=3, guidance_scale=5.0, height=32, width=32)
    theirs = reference_pixels(reference_pipeline(folder, sampler), "a lighthouse at dusk", _noise(), **call)

    # diffusers reads the same file back to the folder's image: the file is a real original checkpoint
    extra = {"text_encoder_2": _diffusers_open_clip(folder, path)} if kind == "sdxl" else {"safety_checker": None}
    ref = cls.from_single_file(str(path), config=str(folder), torch_dtype=torch.float32, **extra)
    ref.scheduler = reference_pipeline(folder, sampler).scheduler
    ref.set_progress_bar_config(disable=True)
    from_file = reference_pixels(ref, "a lighthouse at dusk", _noise(), **call)
    assert mean_abs_px(from_file, theirs) <= MEAN_TOL

    pipe = preheat.load(path, config=folder, cache="off")
    ours = pipe.generate("a lighthouse at dusk", noise=_noise(), steps=3, sampler=sampler, guidance=5.0,
                         width=32, height=32)
    diff = mean_abs_px(ours, theirs)
    record_property("mean_abs_px", diff)
    assert diff <= MEAN_TOL, diff
    assert ours.std() > 5
    converted = list((tmp_path / "home" / "models" / "single").iterdir())
    assert len(converted) == 1  # converted once ...
    again = preheat.load(path, config=folder, cache="off")  # ... and read again as it is
    assert list((tmp_path / "home" / "models" / "single").iterdir()) == converted
    assert np.array_equal(again.generate("a lighthouse at dusk", noise=_noise(), steps=3, sampler=sampler,
                                         guidance=5.0, width=32, height=32), ours)


def test_sd2_projections_stored_as_convolutions_give_the_config_s_linear_layers(files, tmp_path):
    """Some SD 2.x files hold the UNet's transformer ``proj_in``/``proj_out`` as 1x1 convolutions
    ([O, I, 1, 1]); the tiny SD 2.x config has linear ones (``use_linear_projection``), which get the
    folder's own weights either way."""
    from safetensors.numpy import load_file, save_file

    from preheat.models.single_file import materialize

    folder, path = files["sd2"]
    tensors = load_file(str(path))
    projections = [k for k in tensors if k.startswith("model.diffusion_model.") and re.search(r"\.proj_(in|out)\.weight$", k)]
    assert projections and all(tensors[k].ndim == 2 for k in projections)  # SD 2.x files: linear
    conv = tmp_path / "conv.safetensors"
    save_file({k: v[:, :, None, None] if k in projections else v for k, v in tensors.items()}, str(conv))
    want = load_file(str(folder / "unet" / "diffusion_pytorch_model.safetensors"))
    for single in (path, conv):
        got = load_file(str(materialize(single, folder, tmp_path / "home") / "unet" / "diffusion_pytorch_model.safetensors"))
        assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_bad_single_files_are_one_line(single, tmp_path, monkeypatch):
    from safetensors.numpy import load_file, save_file

    folder, path = single
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelFormatError, match=r"cannot tell which published model .*pass config=") as err:
        preheat.load(path, cache="off")  # no config: a tiny file is no published model (tests/models/test_published.py)
    assert "\n" not in str(err.value)

    odd = tmp_path / "odd.safetensors"  # AuraFlow's original layout
    save_file({"double_layers.0.attn.w2q.weight": np.zeros((2, 2), np.float32)}, str(odd))
    with pytest.raises(ModelFormatError, match=r"unknown layout: tried sgm-refiner "
                                               r"\(conditioner\.embedders\.0\.model\.\*\), "
                                               r"sgm \(conditioner\.embedders\.\*\), mmdit "
                                               r"\(joint_blocks\.\*, model\.diffusion_model\.joint_blocks\.\*\), bfl "
                                               r"\(double_blocks\.\*, model\.diffusion_model\.double_blocks\.\*\), "
                                               r"ldm \(model\.diffusion_model\.\*\); its keys start double_layers"):
        preheat.load(odd, config=folder, cache="off")

    tensors = load_file(str(path))
    tensors["model.diffusion_model.input_blocks.9.0.in_layers.0.weight"] = np.zeros(4, np.float32)  # no such block
    extra = tmp_path / "extra.safetensors"
    save_file(tensors, str(extra))
    with pytest.raises(ModelFormatError, match="do not fit the blocks") as err:
        preheat.load(extra, config=folder, cache="off")
    assert "\n" not in str(err.value) and isinstance(err.value, WeightsError)  # the loader's callers' class too


@pytest.fixture(scope="module")
def refiner(tmp_path_factory):
    """(folder, single file): a tiny SDXL refiner (its VAE's posterior deterministic, as the img2img
    tests' folders) and its file in the refiner's SGM layout: OpenCLIP bigG alone, as embedder 0."""
    from safetensors.numpy import save_file

    base = tmp_path_factory.mktemp("refiner")
    folder = image_fixtures.save_image_sd(base / "refiner", "sdxl-refiner")
    path = base / "tiny-refiner-sgm.safetensors"
    save_file(to_original(folder, "sdxl-refiner"), str(path))
    return folder, path


@pytest.mark.slow  # diffusers' from_single_file, three preheat loads (one torch) and the refiner's img2img program
def test_refiner_file_draws_its_folder_s_image(refiner, tmp_path, monkeypatch, record_property):
    """sd_xl_refiner_1.0.safetensors' layout: diffusers' ``StableDiffusionXLImg2ImgPipeline.from_single_file``
    reads the file to the folder's image (the file is a real refiner checkpoint); preheat reads it to
    diffusers' image, to the very pixels of the folder it was written from, and the torch backend to
    the same image."""
    import torch
    from diffusers import StableDiffusionXLImg2ImgPipeline
    from PIL import Image

    folder, path = refiner
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    image, prompt = image_fixtures.sample_image(), "a watercolor fox"
    call = dict(strength=0.6, num_inference_steps=3, guidance_scale=6.0, negative_prompt="blurry", aesthetic_score=7.0)
    from_folder = image_fixtures.reference(folder, "sdxl-refiner", "euler", inpaint=False)
    theirs = image_fixtures.reference_pixels(from_folder, prompt, 3, image=Image.fromarray(image), **call)
    ref = StableDiffusionXLImg2ImgPipeline.from_single_file(str(path), config=str(folder), torch_dtype=torch.float32)
    assert ref.text_encoder is None and ref.config.requires_aesthetics_score
    ref.scheduler = from_folder.scheduler
    ref.set_progress_bar_config(disable=True)
    from_file = image_fixtures.reference_pixels(ref, prompt, 3, image=Image.fromarray(image), **call)
    record_property("diffusers_file_vs_folder_mean_abs_px", mean_abs_px(from_file, theirs))
    assert mean_abs_px(from_file, theirs) <= MEAN_TOL

    eps = image_fixtures.replayed_noise((1, 4, 16, 16), 3, draws_before=1)  # after the image's posterior sample
    ours_call = dict(image=image, strength=0.6, steps=3, guidance=6.0, negative_prompt="blurry", sampler="euler",
                     noise=eps, aesthetic_score=7.0)
    pipe = preheat.load(path, config=folder, cache="off")
    assert pipe.family.name == "stable-diffusion-xl-refiner"
    ours = pipe.generate(prompt, **ours_call)
    diff = mean_abs_px(ours, theirs)
    record_property("mean_abs_px", diff)
    assert diff <= MEAN_TOL, diff
    assert ours.std() > 5
    np.testing.assert_array_equal(ours, preheat.load(folder, cache="off").generate(prompt, **ours_call))
    torch_pipe = preheat.load(path, config=folder, backend="torch")  # the same converted folder, in diffusers
    assert torch_pipe.family.name == "stable-diffusion-xl-refiner"
    assert mean_abs_px(torch_pipe.generate(prompt, **ours_call), ours) <= MEAN_TOL


@pytest.mark.slow  # the tiny refiner folder (the fixture) is built for test-slow only
def test_refiner_file_with_only_a_tokenizer_2_folder_reads_the_shipped_configs(refiner, tmp_path, monkeypatch):
    """Without the whole folder: the refiner's published configs (a tiny stand-in here, as in
    ``test_published``) and ``config=`` a folder holding tokenizer_2/ alone, all a refiner file lacks
    (no first tokenizer); converted to the very files the whole folder as config= gives."""
    import shutil

    from preheat.models import published as module
    from preheat.models.single_file import materialize

    folder, path = refiner
    assets, tokenizers = tmp_path / "assets", tmp_path / "tokenizers"
    shutil.copytree(folder, assets / "tiny-refiner", ignore=shutil.ignore_patterns("*.safetensors", "tokenizer*"))
    shutil.copytree(folder / "tokenizer_2", tokenizers / "tokenizer_2")
    tiny = module.Published("tiny-refiner", "tiny SDXL refiner", "example/tiny-refiner", "sgm-refiner", "any file",
                            lambda shapes: True)
    monkeypatch.setattr(module, "CONFIGS", assets)
    monkeypatch.setattr(module, "PUBLISHED", (tiny,))
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    assert module.needed(path) == module.Needed(tiny, ("tokenizer_2",), ())

    assert preheat.load(path, config=tokenizers, cache="off").family.name == "stable-diffusion-xl-refiner"
    (ours,) = (tmp_path / "home" / "models" / "single").iterdir()
    theirs = materialize(path, folder, tmp_path / "other")
    parts = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*") if p.is_file() and p.parent != theirs)
    assert "text_encoder_2/model.safetensors" in parts and not (theirs / "text_encoder").exists()
    for part in parts + ["model_index.json"]:
        assert (ours / part).read_bytes() == (theirs / part).read_bytes(), part


def test_refiner_and_base_files_with_the_other_s_configs_are_one_line(files, tmp_path, monkeypatch):
    """An SDXL base file with the refiner's configs (no first text encoder), a refiner file with SD 1.x's
    (no ``text_encoder_2``), and a file holding both a refiner's and the base's text embedders: one line
    each, before anything is built. (The refiner-layout file here is the tiny SDXL base's with its CLIP-L
    left out and bigG moved to embedder 0: only the names matter.)"""
    from safetensors.numpy import load_file, save_file

    from preheat.models.published import CONFIGS

    folder, path = files["sdxl"]
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelNotFoundError, match=r"has no text_encoder/config\.json, which a file of the sgm layout "
                                                 r"needs") as err:
        preheat.load(path, config=CONFIGS / "stable-diffusion-xl-refiner-1.0", cache="off")
    assert "\n" not in str(err.value)

    tensors = load_file(str(path))
    as_refiner = {k.replace("conditioner.embedders.1.model.", "conditioner.embedders.0.model."): v
                  for k, v in tensors.items() if not k.startswith("conditioner.embedders.0.transformer.")}
    refiner_layout = tmp_path / "refiner-layout.safetensors"
    save_file(as_refiner, str(refiner_layout))
    with pytest.raises(ModelNotFoundError, match=r"has no text_encoder_2/config\.json, which a file of the "
                                                 r"sgm-refiner layout needs") as err:
        preheat.load(refiner_layout, config=files["sd1"][0], cache="off")
    assert "\n" not in str(err.value)

    both = tmp_path / "both.safetensors"
    save_file({**tensors, **{k: v for k, v in as_refiner.items() if k.startswith("conditioner.")}}, str(both))
    with pytest.raises(ModelFormatError, match=r"\(sgm-refiner layout\) has \d+ tensors that do not fit the blocks .*"
                                               r"e\.g\. conditioner\.embedders\.") as err:
        preheat.load(both, config=folder, cache="off")
    assert "\n" not in str(err.value)
    converted = tmp_path / "home" / "models" / "single"
    assert not converted.is_dir() or not any(converted.iterdir())  # nothing converted


@pytest.fixture(scope="module")
def flux_file(tmp_path_factory):
    """(folder, file): a tiny FLUX.1-dev folder and its transformer in BFL's original layout."""
    from safetensors.numpy import load_file, save_file

    base = tmp_path_factory.mktemp("bfl")
    folder = flow_fixtures.save_tiny_flow_model(base / "flux-dev", "flux-dev")
    path = base / "flux1-tiny.safetensors"
    save_file(to_bfl(load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))), str(path))
    return folder, path


def _diffusers_bfl_transformer(folder, path, monkeypatch):
    """diffusers' ``FluxTransformer2DModel.from_single_file(path, config=folder, subfolder="transformer")``
    (at the tiny widths: ``single_files.diffusers_bfl_at_tiny_widths``)."""
    import torch
    from diffusers import FluxTransformer2DModel

    with diffusers_bfl_at_tiny_widths(folder, monkeypatch):
        return FluxTransformer2DModel.from_single_file(str(path), config=str(folder), subfolder="transformer",
                                                       torch_dtype=torch.float32)


def test_bfl_flux_file_matches_the_folder_it_was_converted_from(flux_file, tmp_path, monkeypatch, record_property):
    from safetensors.numpy import load_file, save_file

    from preheat.models.single_file import materialize

    folder, path = flux_file
    want = load_file(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    # diffusers reads the file back to the folder's transformer: the file is a real BFL checkpoint
    theirs_from_file = _diffusers_bfl_transformer(folder, path, monkeypatch).state_dict()
    assert sorted(theirs_from_file) == sorted(want)
    assert all(np.array_equal(theirs_from_file[k].numpy(), want[k]) for k in want)

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    prompt, call = "a watercolor fox", dict(num_inference_steps=3, guidance_scale=3.5)
    theirs = flow_fixtures.reference_pixels(flow_fixtures.reference_pipeline(folder), prompt, _noise(), **call)
    ours = preheat.load(path, config=folder, cache="off").generate(prompt, noise=_noise(), steps=3,
                                                                   sampler="flow_euler", guidance=3.5, width=32, height=32)
    diff = mean_abs_px(ours, theirs)
    record_property("mean_abs_px", diff)
    assert diff <= MEAN_TOL, diff
    assert ours.std() > 5
    (converted,) = (tmp_path / "home" / "models" / "single").iterdir()
    assert not (converted / "transformer" / "diffusion_pytorch_model.safetensors").is_symlink()  # from the file
    for part in ("vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                 "text_encoder_2/model.safetensors"):  # the folder's own, linked rather than copied
        assert (converted / part).resolve() == (folder / part).resolve()

    # ComfyUI's files put the same names under model.diffusion_model.
    prefixed = tmp_path / "prefixed.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in load_file(str(path)).items()}, str(prefixed))
    got = load_file(str(materialize(prefixed, folder, tmp_path / "other") / "transformer" /
                        "diffusion_pytorch_model.safetensors"))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_other_weights_beside_the_same_configs_are_another_conversion(flux_file, tmp_path):
    """A transformer file's converted folder links the config folder's VAE and text encoders: a
    folder with the same configs and other weights (another fine-tune's text encoder) gets its own."""
    import shutil

    from preheat.models.single_file import materialize

    folder, path = flux_file
    other = tmp_path / "other-te"
    shutil.copytree(folder, other)
    te = other / "text_encoder" / "model.safetensors"  # the same configs and bytes: only where the weights are differs
    ours, theirs = materialize(path, folder, tmp_path / "home"), materialize(path, other, tmp_path / "home")
    assert ours != theirs
    assert (theirs / "text_encoder" / "model.safetensors").resolve() == te.resolve()
    assert materialize(path, other, tmp_path / "home") == theirs  # and reused as before


def test_bfl_files_that_do_not_fit_the_config_are_one_line(flux_file, single, tmp_path, monkeypatch):
    from safetensors.numpy import load_file, save_file

    folder, path = flux_file
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    tensors = load_file(str(path))

    def variant(name: str, **changed: np.ndarray):
        out = tmp_path / f"{name}.safetensors"
        save_file({**tensors, **changed}, str(out))
        return out

    # a fused q/k/v cut by the config's widths: 3 x 32 rows, not 3 x 31
    short = variant("short", **{"double_blocks.0.img_attn.qkv.weight": np.zeros((93, 32), np.float32)})
    with pytest.raises(ModelFormatError, match=r"double_blocks\.0\.img_attn\.qkv\.weight has 93 rows; the blocks of .* "
                                           r"transformer config make 96") as err:
        preheat.load(short, config=folder, cache="off")
    assert "\n" not in str(err.value)
    # any other shape: the loader's check, naming the single file; the conversion is not kept
    wide = variant("wide", **{"img_in.weight": np.zeros((32, 8), np.float32)})
    with pytest.raises(ModelFormatError, match=rf"single file {re.escape(str(wide))} does not fit the configs of .*"
                                           r"x_embedder\.weight has shape \(32, 8\), expected \(32, 16\)") as err:
        preheat.load(wide, config=folder, cache="off")
    assert "\n" not in str(err.value) and not list((tmp_path / "home" / "models" / "single").iterdir())
    # a block the config does not have
    extra = variant("extra", **{"single_blocks.7.linear2.weight": np.zeros((32, 160), np.float32)})
    with pytest.raises(ModelFormatError, match=r"1 tensors that do not fit the blocks .* single_blocks\.7\.linear2"):
        preheat.load(extra, config=folder, cache="off")
    # a Flux file with an SD folder's configs, and the other way round
    with pytest.raises(ModelNotFoundError, match=r"has no transformer/config\.json, which a file of the bfl layout needs"):
        preheat.load(path, config=single[0], cache="off")
    with pytest.raises(ModelNotFoundError, match=r"has no unet/config\.json, which a file of the ldm layout needs"):
        preheat.load(single[1], config=folder, cache="off")


def test_every_surface_takes_a_single_file_with_its_config(single, tmp_path, monkeypatch):
    """``--config`` on the CLI (sample; warm and serve share the declaration), ``PREHEAT_CONFIG`` on
    Runpod: the single file is read with the folder's configs, the image is the Python call's."""
    from click.testing import CliRunner
    from PIL import Image

    from preheat.cli import main
    from preheat.integrations.runpod import config_from_env

    folder, path = single
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    want = preheat.load(path, config=folder, cache="off").generate("a fox", steps=2, seed=3)[0]
    out = tmp_path / "fox.png"
    result = CliRunner().invoke(main, ["sample", str(path), "--config", str(folder), "--prompt", "a fox", "--steps",
                                       "2", "--seed", "3", "--cache", "off", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    got = np.asarray(Image.open(out).convert("RGB"))
    assert got.shape[:2] in ((32, 32), (64, 64))  # the grid of one image, maybe upscaled for viewing
    step = got.shape[0] // 32
    np.testing.assert_array_equal(got[::step, ::step], want)

    dry = CliRunner().invoke(main, ["warm", str(path), "--config", str(folder), "--max-batch-size", "1",
                                    "--guidance", "off", "--dry-run"])
    assert dry.exit_code == 0 and "signature(s), " in dry.output, dry.output  # the folder's programs, listed
    missing = CliRunner().invoke(main, ["sample", str(path), "--prompt", "a fox", "--cache", "off", "--quiet",
                                        "--out", str(tmp_path / "x.png")])
    assert missing.exit_code != 0 and "config" in missing.output and len(missing.output.strip().splitlines()) == 1

    runpod = config_from_env({"PREHEAT_MODEL": str(path), "PREHEAT_CONFIG": str(folder)})
    assert runpod.config == str(folder) and runpod.warm_set().config == str(folder)


def test_a_variant_picks_the_weights_a_transformer_file_lacks(flux_file, tmp_path, monkeypatch):
    """``variant="fp16"`` with a single file, as diffusers' ``from_single_file`` takes it: the file's
    own weights are what it holds; the variant picks the config folder's weights of the components
    it lacks (a FLUX.1 transformer file: the VAE, the text encoders). The converted folder has no
    variants, so the load reads it as it is: the image is the folder's own with that variant.
    A config folder without that variant is one line naming it."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder, path = flux_file
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    variants = tmp_path / "variants"
    shutil.copytree(folder, variants)
    for comp, stem in (("transformer", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"),
                       ("text_encoder", "model"), ("text_encoder_2", "model")):  # "fp16" is only a name here:
        tensors = load_file(str(folder / comp / f"{stem}.safetensors"))  # the same weights, but the VAE's
        if comp == "vae":  # last bias shifted, so that the image tells which VAE was read
            tensors["decoder.conv_out.bias"] = tensors["decoder.conv_out.bias"] + np.float32(0.3)
        save_file(tensors, str(variants / comp / f"{stem}.fp16.safetensors"))
    prompt = "a watercolor fox"
    call = dict(noise=_noise(), steps=2, sampler="flow_euler", guidance=3.5, width=32, height=32)

    ours = preheat.load(path, config=variants, variant="fp16", cache="off").generate(prompt, **call)
    want = preheat.load(variants, variant="fp16", cache="off").generate(prompt, **call)
    np.testing.assert_array_equal(ours, want)
    default = preheat.load(path, config=variants, cache="off").generate(prompt, **call)  # another conversion
    assert mean_abs_px(default, ours) > 3  # the shifted VAE's image is another
    fp16, plain = sorted((tmp_path / "home" / "models" / "single").iterdir(),
                         key=lambda p: "fp16" not in str((p / "vae" / "diffusion_pytorch_model.safetensors").resolve()))
    assert (fp16 / "vae" / "diffusion_pytorch_model.safetensors").samefile(
        variants / "vae" / "diffusion_pytorch_model.fp16.safetensors")
    assert (plain / "vae" / "diffusion_pytorch_model.safetensors").samefile(
        variants / "vae" / "diffusion_pytorch_model.safetensors")
    assert not [p for p in fp16.rglob("*") if ".fp16." in p.name]  # a folder without variants

    with pytest.raises(ModelNotFoundError, match=r"flux1-tiny\.safetensors lacks (text_encoder|vae).*, whose 'fp16' "
                                                 r"weights config .* does not have: .*variant 'fp16'") as err:
        preheat.load(path, config=folder, variant="fp16", cache="off")
    assert "\n" not in str(err.value)
