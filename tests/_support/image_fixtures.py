"""Tiny SD / SDXL folders for image-conditioned calls (img2img, inpainting), and diffusers' references.

The folders are ``sd_fixtures``' with two changes:

* the VAE posterior's variance is negligible (the encoder's ``quant_conv`` logvar half: weight 0,
  bias -30, so std = e^-15): diffusers samples ``latent_dist`` with the generator, preheat with its
  seeds, and both then give the mean -- nothing about how either samples is changed;
* ``inpaint=True`` puts a 9-channel UNet in (sample + mask + masked-image latents) and saves the
  folder as diffusers' ``StableDiffusion[XL]InpaintPipeline``.

diffusers' img2img draws ε after the posterior sample of the image from one generator;
``replayed_noise`` draws the same ε, so preheat can be given exactly what diffusers adds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests._support import sd_fixtures
from tests._support.shared_folders import built_once
from tests._support.unet_condition_fixtures import save_tiny_unet_condition

INPAINT_CLASS = {"sd1": "StableDiffusionInpaintPipeline", "sdxl": "StableDiffusionXLInpaintPipeline",
                 "sdxl-refiner": "StableDiffusionXLInpaintPipeline"}
IMG2IMG_CLASS = {"sd1": "StableDiffusionImg2ImgPipeline", "sdxl": "StableDiffusionXLImg2ImgPipeline",
                 "sdxl-refiner": "StableDiffusionXLImg2ImgPipeline"}
# a refiner's pipelines are told so by their config, which a pipeline built from components lacks
REFINER_CONFIG = {"requires_aesthetics_score": True, "force_zeros_for_empty_prompt": False}


@built_once  # written once per run, copied to each caller (tests/_support/shared_folders.py)
def save_image_sd(directory: str | Path, kind: str = "sd1", inpaint: bool = False, seed: int = 0) -> Path:
    """A tiny ``kind`` folder (32x32 images) with a deterministic VAE posterior; ``inpaint``: a 9-channel UNet."""
    import torch
    from diffusers import AutoencoderKL

    directory = Path(directory)
    sd_fixtures.save_tiny_sd(directory, kind=kind, seed=seed)
    vae = AutoencoderKL.from_pretrained(directory / "vae")
    half = vae.config.latent_channels
    with torch.no_grad():
        vae.quant_conv.weight[half:] = 0.0
        vae.quant_conv.bias[half:] = -30.0
    vae.save_pretrained(directory / "vae")
    if inpaint:
        save_tiny_unet_condition(directory / "unet", kind=kind, seed=seed + 7, in_channels=2 * half + 1)
        index_path = directory / "model_index.json"
        index = json.loads(index_path.read_text())
        index["_class_name"] = INPAINT_CLASS[kind]
        index_path.write_text(json.dumps(index, indent=2))
    return directory


def reference(folder: Path, kind: str, sampler: str, inpaint: bool) -> Any:
    """diffusers' img2img (or inpaint) pipeline for ``folder`` with the scheduler preheat maps ``sampler`` to."""
    import diffusers

    base = sd_fixtures.reference_pipeline(folder, sampler)
    cls = getattr(diffusers, (INPAINT_CLASS if inpaint else IMG2IMG_CLASS)[kind])
    components = {k: v for k, v in base.components.items() if k in cls._get_signature_keys(cls)[0]}
    pipe = cls(**components, **(REFINER_CONFIG if kind == "sdxl-refiner" else {}))
    if kind == "sd1":
        pipe.register_to_config(requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def replayed_noise(shape: tuple[int, ...], seed: int, draws_before: int) -> np.ndarray:
    """The ε a diffusers pipeline seeded with ``seed`` draws after ``draws_before`` draws of ``shape``
    (img2img: 1, the image's posterior sample)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for _ in range(draws_before):
        torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen).numpy()


def reference_pixels(pipe: Any, prompt: str, seed: int, **kwargs: Any) -> np.ndarray:
    """diffusers' images (uint8, NHWC) from a call seeded with ``seed`` (PIL images when the call
    has ``padding_mask_crop``: diffusers pastes the crop back into PIL outputs only)."""
    import torch

    pil = kwargs.get("padding_mask_crop") is not None
    with torch.no_grad():
        out = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="pil" if pil else "np",
                   **kwargs).images
    if pil:
        return np.stack([np.asarray(image) for image in out])
    return (np.asarray(out) * 255).round().astype(np.uint8)


def sample_image(size: int = 32, seed: int = 0, width: int | None = None) -> np.ndarray:
    """A smooth uint8 RGB image (size, width or size, 3): gradients a VAE keeps, plus a little texture."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:width or size] / size
    base = np.stack([xx, yy, (xx + yy) / 2], -1) * 200 + 20
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def sample_mask(size: int = 32) -> np.ndarray:
    """A uint8 mask (H, W): white (repaint) in a centred square with one soft edge to binarize."""
    m = np.zeros((size, size), np.uint8)
    m[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 255
    m[size // 4: 3 * size // 4, 3 * size // 4] = 140  # >= 0.5 after /255: repaint
    return m


def corner_mask(height: int = 32, width: int = 48) -> np.ndarray:
    """A uint8 mask (H, W) white in a small box by the bottom edge, right of centre, with a soft
    edge: padding_mask_crop's box around it runs past the image and is shifted back inside."""
    m = np.zeros((height, width), np.uint8)
    m[height - 6: height - 1, width - 14: width - 6] = 255
    m[height - 6: height - 1, width - 6] = 100  # < 0.5 after /255: kept, yet inside the crop box
    return m
