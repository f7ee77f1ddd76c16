"""The built-in text-to-image model (``builtin:text-digits``): shipped in the package, drawn as
prompted by an independent classifier's reading, loaded by diffusers' own StableDiffusionPipeline
with the same pixels, and reproducible by ``preheat train-text-digits`` (run here for a few steps
of a narrower model: the real run takes minutes)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from click.testing import CliRunner

import preheat
from preheat.cli import main
from preheat.engine import BUILTIN_MODELS
from preheat.errors import InvalidArgumentError
from tests._support.numerics import px_diff

FOLDER = BUILTIN_MODELS["text-digits"]
NAMES = "zero one two three four five six seven eight nine".split()


# Shipped only if the classifier gate passes (issue 32): until the folder is in the package, the
# tests of the shipped model have nothing to test and say so; the trainer's test always runs.
shipped = pytest.mark.skipif(not (FOLDER / "model_index.json").is_file(),
                             reason="builtin:text-digits is not shipped: `preheat train-text-digits --out "
                                    "src/preheat/assets/text_digits` trains it and scores it")


@pytest.fixture(scope="module")
def pipe():
    return preheat.load("builtin:text-digits", cache="off")


def _digits_8x8(images: np.ndarray) -> np.ndarray:
    """(N, 16, 16, 3) uint8 -> (N, 64) on load_digits' 0..16 scale: grey level, 2x2 block means."""
    grey = images.astype(np.float64).mean(-1) / 255.0
    return grey.reshape(len(grey), 8, 2, 8, 2).mean((2, 4)).reshape(len(grey), 64) * 16.0


@shipped
def test_ships_in_the_package_as_a_stable_diffusion_folder_under_10_mb():
    files = [p for p in FOLDER.rglob("*") if p.is_file()]
    names = {p.relative_to(FOLDER).as_posix() for p in files}
    assert {"model_index.json", "README.md", "scheduler/scheduler_config.json", "text_encoder/config.json",
            "text_encoder/model.safetensors", "tokenizer/vocab.json", "tokenizer/merges.txt",
            "unet/config.json", "unet/diffusion_pytorch_model.safetensors", "vae/config.json",
            "vae/diffusion_pytorch_model.safetensors"} <= names
    assert sum(p.stat().st_size for p in files) <= 10 * 1024 * 1024
    assert json.loads((FOLDER / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"
    card = (FOLDER / "README.md").read_text()
    assert "preheat train-text-digits" in card and "load_digits" in card and "with the UNet" in card


@shipped
def test_an_independent_classifier_reads_the_prompted_digit_in_90_of_100_samples(pipe):
    """The ship gate: an SVC trained on the real 8x8 digits, 100 samples over the 10 digits
    ("a 7" and "a seven" alike), fixed seeds."""
    from sklearn.datasets import load_digits
    from sklearn.svm import SVC

    digits = load_digits()
    classifier = SVC(gamma=0.001).fit(digits.data, digits.target)
    wanted = np.arange(100) % 10
    prompts = [f"a {d}" if (i // 10) % 2 else f"a {NAMES[d]}" for i, d in enumerate(wanted)]
    images = pipe.generate(prompts, seed=0)
    assert images.shape == (100, 16, 16, 3)
    agreement = float((classifier.predict(_digits_8x8(images)) == wanted).mean())
    print(f"classifier agreement {agreement:.2f}")
    assert agreement >= 0.9
    claimed = re.search(r"(\d+)% of 100 samples", (FOLDER / "README.md").read_text())
    assert claimed and abs(int(claimed.group(1)) / 100 - agreement) <= 0.05  # the card says what is measured


@shipped
def test_bold_draws_more_ink_than_plain_and_thin_less(pipe):
    ink = {style: pipe.generate([f"a {style} {d}".replace("  ", " ") for d in range(10)], seed=3).mean()
           for style in ("bold", "", "thin")}
    assert ink["bold"] > ink[""] > ink["thin"], ink


@shipped
def test_diffusers_loads_it_and_draws_the_same_pixels(pipe):
    import torch
    from diffusers import StableDiffusionPipeline

    ref = StableDiffusionPipeline.from_pretrained(FOLDER)
    ref.set_progress_bar_config(disable=True)
    prompts = ["a seven", "a bold 3", "a thin 0", "an eight"]
    noise = np.random.default_rng(0).standard_normal((4, 4, 8, 8)).astype(np.float32)
    with torch.no_grad():
        theirs = ref(prompt=prompts, latents=torch.from_numpy(noise), num_inference_steps=10, guidance_scale=7.5,
                     height=16, width=16, output_type="np").images
    theirs = (np.asarray(theirs) * 255).round().astype(np.uint8)
    ours = pipe.generate(prompts, noise=noise, steps=10, sampler="ddim", guidance=7.5)
    diff = px_diff(ours, theirs)
    print(f"mean |Δpx| {diff.mean():.4f}, max {diff.max()}")
    assert diff.mean() <= 1.0 and ours.std() > 20


def test_unknown_builtin_name_is_one_line_naming_the_choices():
    with pytest.raises(InvalidArgumentError, match="builtin:digits, builtin:text-digits"):
        preheat.load("builtin:cats")


@pytest.mark.slow
def test_train_text_digits_command_writes_a_folder_diffusers_and_preheat_load(tmp_path):
    from diffusers import StableDiffusionPipeline

    out = tmp_path / "m"
    result = CliRunner().invoke(main, ["train-text-digits", "--out", str(out), "--tiny", "--no-check", "--seed", "3"])
    assert result.exit_code == 0, result.output
    losses = [float(m) for m in re.findall(r"loss (\S+)", result.stderr)]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), result.stderr  # the VAE's, the UNet's
    assert "--seed 3" in (out / "README.md").read_text()
    StableDiffusionPipeline.from_pretrained(out)  # every component in diffusers' layout
    images = preheat.load(out, cache="off").generate(["a 7", "a thin two"], steps=2, seed=0)
    assert images.shape == (2, 16, 16, 3)


def test_the_command_s_defaults_are_the_shipped_run_s():
    """`preheat train-text-digits --out DIR` with no other flag reproduces the shipped model's run
    (the card's command): the CLI states TextDigitsConfig's defaults without importing jax."""
    from preheat.cli.train import train_text_digits_command
    from preheat.train.text_digits import TextDigitsConfig

    defaults = {p.name: p.default for p in train_text_digits_command.params}
    config = TextDigitsConfig()
    assert {k: defaults[k] for k in ("vae_steps", "unet_steps", "batch", "seed", "lr")} == \
        {k: getattr(config, k) for k in ("vae_steps", "unet_steps", "batch", "seed", "lr")}
    card = (FOLDER / "README.md").read_text() if (FOLDER / "README.md").is_file() else ""
    assert not card or f"--unet-steps {config.unet_steps} " in card
