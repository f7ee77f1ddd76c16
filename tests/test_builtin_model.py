"""The built-in digits model: ships in the package, loads in torch, draws the digits asked for,
and JAX sampling matches torch (diffusers UNet + diffusers scheduler) from the same noise."""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.engine import BUILTIN_MODEL


@pytest.fixture(scope="module")
def pipe():
    return preheat.load(cache="off")


def test_ships_in_the_package_under_5_mb():
    files = [p for p in BUILTIN_MODEL.rglob("*") if p.is_file()]
    names = {p.relative_to(BUILTIN_MODEL).as_posix() for p in files}
    assert {"model_index.json", "README.md", "unet/config.json", "unet/diffusion_pytorch_model.safetensors",
            "scheduler/scheduler_config.json"} <= names
    assert sum(p.stat().st_size for p in files) <= 5 * 1024 * 1024
    assert "preheat train-digits" in (BUILTIN_MODEL / "README.md").read_text()


def test_torch_diffusers_loads_it():
    from diffusers import UNet2DModel

    model = UNet2DModel.from_pretrained(BUILTIN_MODEL, subfolder="unet")
    assert model.config.num_class_embeds == 11


def _classifier():
    from sklearn.datasets import load_digits
    from sklearn.svm import SVC

    digits = load_digits()
    return SVC(gamma=0.001, C=10.0).fit(digits.data, digits.target)


@pytest.mark.slow
def test_quality_an_independent_classifier_agrees_with_the_requested_class(pipe):
    per_class = 10
    labels = np.repeat(np.arange(10), per_class)
    pixels = pipe.generate(len(labels), class_labels=labels.tolist(), seed=1234)  # the model's defaults
    x = pixels[..., 0].astype(np.float32) / 255.0 * 16.0  # (N, 16, 16) on the 0..16 scale of load_digits
    x8 = x.reshape(-1, 8, 2, 8, 2).mean(axis=(2, 4)).reshape(len(labels), 64)  # 2x2 average -> 8x8
    predicted = _classifier().predict(x8)
    agreement = float((predicted == labels).mean())
    print(f"classifier agreement: {agreement:.3f}")
    assert agreement >= 0.90, (agreement, predicted.reshape(10, per_class))


@pytest.mark.parametrize("sampler", ["dpmpp_2m", "ddim", "euler", "heun", "dpmpp_2m_karras"])
def test_jax_matches_torch_from_the_same_noise(pipe, sampler):
    import json

    import torch
    from diffusers import UNet2DModel

    from preheat.backends.torch import make_scheduler, sample_loop

    n, steps, guidance = 8, 12, 2.0
    labels = np.arange(n) % 10
    noise = np.random.RandomState(0).randn(n, 1, 16, 16).astype(np.float32)
    ours = pipe.generate(n, class_labels=labels.tolist(), noise=noise, sampler=sampler, steps=steps, guidance=guidance)
    unet = UNet2DModel.from_pretrained(BUILTIN_MODEL, subfolder="unet").eval()
    config = json.loads((BUILTIN_MODEL / "scheduler" / "scheduler_config.json").read_text())
    theirs = sample_loop(unet, make_scheduler(sampler, config), torch.from_numpy(noise), steps,
                         class_labels=torch.from_numpy(labels), guidance=guidance, null_class=pipe.null_class)
    diff = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
    print(f"{sampler}: mean abs pixel diff {diff.mean():.4f}, max {diff.max():.0f} (of 255)")
    assert diff.mean() <= 1.0, diff.mean()  # <= 1/255 on the [0, 1] scale
