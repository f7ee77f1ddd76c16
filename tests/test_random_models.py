"""`random:NAME` folders: one set of names for sample, pull, warm, serve and bench; each folder is a
standard diffusers pipeline (diffusers loads and runs it) that preheat serves at its tiny size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from preheat.cli import main

TINY = ("sd1-tiny", "sdxl-tiny", "sd3-tiny", "flux-tiny", "kontext-tiny", "fill-tiny")
CLASSES = {"sd1-tiny": "StableDiffusionPipeline", "sdxl-tiny": "StableDiffusionXLPipeline",
           "sd3-tiny": "StableDiffusion3Pipeline", "flux-tiny": "FluxPipeline", "kontext-tiny": "FluxKontextPipeline",
           "fill-tiny": "FluxFillPipeline"}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("random-home")


@pytest.fixture(scope="module")
def folders(home):
    """`preheat pull random:NAME` for each tiny one: the folder's path on stdout, built once."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREHEAT_HOME", str(home))
        for name in TINY:
            r = CliRunner().invoke(main, ["pull", f"random:{name}", "--quiet"])
            assert r.exit_code == 0, r.output
            out[name] = Path(r.stdout.strip().splitlines()[-1])
            again = CliRunner().invoke(main, ["pull", f"random:{name}", "--quiet"])
            assert again.stdout.strip().splitlines()[-1] == str(out[name])  # reused, not rebuilt
    return out


@pytest.mark.parametrize("name", TINY)
def test_a_tiny_random_folder_is_a_diffusers_pipeline(folders, name):
    import torch
    from diffusers import DiffusionPipeline

    folder = folders[name]
    assert folder.parent.name == "random" and json.loads((folder / "model_index.json").read_text())["_class_name"] == CLASSES[name]
    pipe = DiffusionPipeline.from_pretrained(folder)
    assert type(pipe).__name__ == CLASSES[name]
    # Kontext: a reference kept at its size, and diffusers' max_area (1024**2 by default) at the tiny size
    from PIL import Image

    grey = Image.new("RGB", (32, 32), (128, 128, 128))
    edit = {"kontext-tiny": dict(image=grey, max_area=32 * 32, _auto_resize=False),
            "fill-tiny": dict(image=grey, mask_image=Image.new("L", (32, 32), 255))}.get(name, {})
    with torch.no_grad():
        image = pipe(prompt="a photo of a cat", num_inference_steps=1, width=32, height=32, output_type="np",
                     generator=torch.Generator().manual_seed(0), **edit).images[0]
    assert image.shape == (32, 32, 3) and np.isfinite(image).all()


@pytest.mark.parametrize("name", ["sd3-tiny"])
def test_preheat_samples_a_tiny_random_model_at_its_tiny_size(folders, home, name, tmp_path, monkeypatch):
    """`preheat sample random:NAME` with no --width/--height: 32x32 (the family default would be
    the published model's), the grid's upscaling stated."""
    monkeypatch.setenv("PREHEAT_HOME", str(home))
    r = CliRunner().invoke(main, ["sample", f"random:{name}", "--prompt", "a fox", "--steps", "1", "--out",
                                  str(tmp_path / "s.png"), "--json"])
    assert r.exit_code == 0, r.output
    assert "1 images of 32x32" in r.stderr and "upscaled 2x" in r.stderr
    record = json.loads(r.stdout)
    assert record["batch"] == 1 and record["steps"] == 1
    assert record["image_size"] == [32, 32] and record["grid_upscale"] == 2


def test_unknown_random_name_lists_the_names():
    r = CliRunner().invoke(main, ["sample", "random:sd9", "--out", "x.png"])
    assert r.exit_code == 2
    assert r.stderr.strip() == ("error: unknown random model 'random:sd9'; choose from random:sd1-tiny, "
                                "random:sdxl-tiny, random:sd3-tiny, random:flux-tiny, random:kontext-tiny, random:fill-tiny, "
                                "random:sd-small, random:sd15, "
                                "random:flux, random:ddpm-cifar10-32, random:sdxl, random:flux-dev, random:kontext-dev")


def test_serve_and_warm_take_random_names_at_their_tiny_size(folders, home, monkeypatch):
    """The declaration keeps ``random:NAME`` as given (``preheat.load`` reads its folder); resolving
    it serves a tiny model at its tiny size unless sizes are given, for the CLI, Runpod and Ray alike."""
    import preheat
    from preheat.settings import ServeSettings
    from preheat.warm import resolve

    monkeypatch.setenv("PREHEAT_HOME", str(home))
    ws = ServeSettings(model="random:flux-tiny", max_batch_size=2).warm_set()
    assert ws.model == "random:flux-tiny" and ws.sizes == ()
    pipe = preheat.load("random:flux-tiny", cache="off")
    assert resolve(pipe, ws).sizes == ((32, 32),)
    ws = ServeSettings(model="random:flux-tiny", max_batch_size=2, sizes="64x32").warm_set()
    assert resolve(pipe, ws).sizes == ((64, 32),)


def test_warm_takes_a_random_name_at_its_tiny_size(folders, home, monkeypatch):
    """`preheat warm random:NAME --dry-run`: the programs a server of it would run, at 32x32 (read
    from the folder written once; nothing compiled)."""
    monkeypatch.setenv("PREHEAT_HOME", str(home))
    r = CliRunner().invoke(main, ["warm", "random:sd1-tiny", "--max-batch-size", "1", "--guidance", "off",
                                  "--inputs", "none", "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["signatures"]
    assert rows and all(" 32x32" in row["signature"] for row in rows), rows


def test_a_server_serves_a_random_model_over_http(folders, home, monkeypatch):
    """A real server on 127.0.0.1 for ``random:sd1-tiny`` (as Runpod and Ray configure it: the name
    in ``CoreConfig.model``): set up from the name, a prediction at its tiny size."""
    import base64
    import io

    import httpx
    from PIL import Image

    from preheat.server.core import CoreConfig
    from tests._support.server_fixtures import served_core

    monkeypatch.setenv("PREHEAT_HOME", str(home))
    config = CoreConfig(model="random:sd1-tiny", cache="off", max_batch_size=1, guidance=("off",), inputs=())
    with served_core(config) as (core, server), httpx.Client(base_url=server.url, timeout=300) as client:
        assert core.warm.sizes == ((32, 32),)
        r = client.post("/predictions", json={"input": {"prompt": "a fox", "num_inference_steps": 1,
                                                        "guidance_scale": 1.0}})
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
        png = base64.b64decode(r.json()["output"][0].split(",", 1)[1])
        assert Image.open(io.BytesIO(png)).size == (32, 32)


def test_bench_children_get_the_inputs_a_family_declares_required(folders, home, tmp_path, monkeypatch):
    """`bench coldstart`'s parent reads no weight: it gives each child the required inputs the
    folder's family declares, at their example values (a Kontext folder: a prompt and a reference
    image it writes), and the children's command line runs."""
    from PIL import Image

    from preheat.cli.bench import declared_args, required_example_args

    kontext = required_example_args(str(folders["kontext-tiny"]), ("--width", "32", "--height", "24"), tmp_path)
    assert kontext[:3] == ("--prompt", "a watercolor fox", "--image")
    assert Image.open(kontext[3]).size == (32, 24)
    assert required_example_args(str(folders["sd1-tiny"]), (), tmp_path) == ("--prompt", "a watercolor fox")
    assert required_example_args(str(folders["sd1-tiny"]), ("--prompt", "a cat"), tmp_path) == ()
    assert required_example_args(None, (), tmp_path) == ()  # the built-in model: class labels have a default
    assert required_example_args("hf://org/repo", (), tmp_path) == ()  # not pulled here: the caller's to give
    # a random model's tiny-scale inputs go to the children under the flags their specs declare
    assert declared_args(str(folders["kontext-tiny"]), {"image_resize": "none", "width": 32}) == \
        ("--image-resize", "none", "--width", "32")
    assert declared_args(str(folders["sd1-tiny"]), {"mask_image": "m.png"}) == ("--mask", "m.png")

    monkeypatch.setenv("PREHEAT_HOME", str(home))  # random:kontext-tiny: 32x32 and the reference kept at its size
    r = CliRunner().invoke(main, ["sample", "random:kontext-tiny", *kontext, "--steps", "1", "--out",
                                  str(tmp_path / "k.png"), "--json", "--cache", "off"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["image_size"] == [32, 32]


def _config_folder(root: Path, index: dict, unet_in: int) -> Path:
    """A pipeline folder of configs alone: what the bench's parent reads (it reads no weight)."""
    for name, config in (("model_index.json", index), ("unet/config.json", {"in_channels": unet_in}),
                         ("vae/config.json", {"latent_channels": 4})):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(config))
    return root


def test_bench_children_get_what_the_folder_configs_require(tmp_path):
    """A refiner's index (the base img2img class with requires_aesthetics_score) is the refiner family
    (its image required, its aesthetic score a flag), and a 9-channel UNet needs an image and a mask:
    the bench's parent tells both from the configs, as the loaded model does."""
    from PIL import Image

    from preheat.bench.compare import declared_values
    from preheat.cli.bench import required_example_args
    from preheat.families import declared_family

    parts = {"unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]}
    refiner = _config_folder(tmp_path / "refiner", {"_class_name": "StableDiffusionXLImg2ImgPipeline",
                                                    "requires_aesthetics_score": True, **parts}, 4)
    assert declared_family(refiner).name == "stable-diffusion-xl-refiner"
    args = required_example_args(str(refiner), ("--width", "40", "--height", "24"), tmp_path)
    assert args[:3] == ("--prompt", "a watercolor fox", "--image") and len(args) == 4
    assert Image.open(args[3]).size == (40, 24)
    assert declared_values(str(refiner), {"--aesthetic-score": ["7"]}) == {"aesthetic_score": 7.0}

    base = _config_folder(tmp_path / "base", {"_class_name": "StableDiffusionXLImg2ImgPipeline", **parts}, 4)
    assert declared_family(base).name == "stable-diffusion-xl"
    assert required_example_args(str(base), (), tmp_path) == ("--prompt", "a watercolor fox")
    with pytest.raises(Exception, match="--aesthetic-score does not apply to a stable-diffusion-xl model"):
        declared_values(str(base), {"--aesthetic-score": ["7"]})

    inpaint = _config_folder(tmp_path / "inpaint", {"_class_name": "StableDiffusionInpaintPipeline", **parts}, 9)
    args = required_example_args(str(inpaint), ("--prompt", "a cat"), tmp_path)
    assert [a for a in args if a.startswith("--")] == ["--image", "--mask"]
    assert np.asarray(Image.open(args[3])).min() == 255  # the mask: repaint everything
    assert required_example_args(str(_config_folder(tmp_path / "sd", {"_class_name": "StableDiffusionPipeline",
                                                                      **parts}, 4)), ("--prompt", "a"), tmp_path) == ()


def test_bench_coldstart_passes_the_family_flags_to_every_child_and_refuses_others(folders, tmp_path, monkeypatch):
    """`bench coldstart`'s model inputs are `preheat sample`'s family flags: given to each child as
    they are (plus the required ones at their example values); a flag the family does not declare
    is one line before any child starts."""
    import preheat.bench.coldstart as coldstart

    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(coldstart, "bench_coldstart", lambda *a, **k: calls.append(a[-1]) or {})
    monkeypatch.setattr(coldstart, "markdown", lambda result: "")
    from PIL import Image

    Image.new("RGB", (32, 32), (90, 120, 150)).save(tmp_path / "in.png")
    sd1 = str(folders["sd1-tiny"])
    r = CliRunner().invoke(main, ["bench", "coldstart", sd1, "--n", "1", "--prompt", "a cat", "--width", "32",
                                  "--height", "32", "--strength", "0.5", "--image", str(tmp_path / "in.png")])
    assert r.exit_code == 0, r.output
    assert calls == [("--prompt", "a cat", "--width", "32", "--height", "32", "--strength", "0.5",
                      "--image", str(tmp_path / "in.png"))]
    r = CliRunner().invoke(main, ["bench", "coldstart", sd1, "--class", "3"])
    assert r.exit_code != 0 and len(calls) == 1
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert line.startswith("error: ") and "--class" in line, line


def test_full_size_architectures_have_the_published_parameter_counts():
    """random:sdxl, random:flux-dev and random:kontext-dev (the GPU check's rows 3-5) are the whole
    published models: their configs, built on torch's meta device (no memory), give the parameter
    counts of stabilityai/stable-diffusion-xl-base-1.0 and black-forest-labs/FLUX.1-dev."""
    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from preheat.bench import random_models as rm

    def count(model: torch.nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())

    with torch.device("meta"):
        assert count(UNet2DConditionModel(**rm.SDXL_UNET)) == 2_567_463_684
        assert count(CLIPTextModel(CLIPTextConfig(**rm.SDXL_CLIP))) == 123_060_480
        assert count(CLIPTextModelWithProjection(CLIPTextConfig(**rm.SDXL_CLIP_G))) == 694_659_840
        assert count(AutoencoderKL(**rm.SDXL_VAE)) == 83_653_863
        assert count(FluxTransformer2DModel(**rm.FLUX_DEV_TRANSFORMER)) == 11_901_408_320
        assert count(T5EncoderModel(T5Config(**rm.FLUX_DEV_T5))) == 4_762_310_656
        assert count(CLIPTextModel(CLIPTextConfig(**rm.FLUX_DEV_CLIP))) == 123_060_480


def test_the_full_size_sdxl_writer_at_tiny_widths_writes_a_bfloat16_pipeline(tmp_path):
    """save_random_sdxl's code path (the GPU writes it at full size), with the tiny configs, on the CPU."""
    import torch
    from diffusers import StableDiffusionXLPipeline
    from safetensors import safe_open

    from preheat.bench import random_models as rm

    folder = rm.save_random_sdxl(tmp_path / "sdxl", dtype="bfloat16", device="cpu", unet=rm.TINY_SDXL_UNET,
                                 clip=rm.TINY_SDXL_CLIP, clip_g={**rm.TINY_SDXL_CLIP, "hidden_act": "gelu"},
                                 vae=rm.TINY_VAE)
    with safe_open(str(folder / "unet" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    pipe = StableDiffusionXLPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    assert pipe.unet.dtype == torch.bfloat16 and pipe.text_encoder_2.config.hidden_act == "gelu"
