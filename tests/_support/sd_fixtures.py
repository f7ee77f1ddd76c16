"""Tiny random-weight SD 1.x, SD 2.x (v-prediction) and SDXL pipeline folders, written by diffusers.

Each folder is a real ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline`` saved with
``save_pretrained`` (so ``model_index.json`` is diffusers' own), built from the model tests'
tiny components. ``reference_pipeline(folder)`` loads it back in diffusers as the reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests._support.shared_folders import built_once
from tests._support.text_fixtures import save_tiny_clip, save_tiny_tokenizer
from tests._support.unet_condition_fixtures import save_tiny_unet_condition
from tests._support.vae_fixtures import save_tiny_vae

KINDS = ("sd1", "sd2", "sdxl")
SCHEDULER = {"num_train_timesteps": 1000, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
             "beta_end": 0.012, "steps_offset": 1, "timestep_spacing": "leading"}
DDIM_EXTRA = {"clip_sample": False, "set_alpha_to_one": False}


@built_once  # written once per run, copied to each caller (tests/_support/shared_folders.py)
def save_tiny_sd(directory: str | Path, kind: str = "sd1", seed: int = 0) -> Path:
    """A whole tiny pipeline folder of ``kind`` ("sd1", "sd2", "sdxl", "sdxl-refiner": a
    ``StableDiffusionXLImg2ImgPipeline`` with the second encoder alone and aesthetic-score ids, as
    stable-diffusion-xl-refiner-1.0); 32x32 images, 16x16 latents."""
    import torch
    from diffusers import (DDIMScheduler, EulerDiscreteScheduler, StableDiffusionPipeline,
                           StableDiffusionXLImg2ImgPipeline, StableDiffusionXLPipeline, AutoencoderKL,
                           UNet2DConditionModel)
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    directory = Path(directory)
    parts = directory.parent / f".{directory.name}-parts"
    if kind == "sdxl-refiner":  # the refiner's UNet: context = the second encoder's 16, ids 16 + 5 x 8
        save_tiny_clip(parts / "te2", with_projection=True, seed=seed + 1, hidden_size=16, num_attention_heads=2,
                       projection_dim=16, hidden_act="gelu")
        save_tiny_tokenizer(parts / "tok2", pad_token="!")
    elif kind == "sdxl":
        save_tiny_clip(parts / "te", seed=seed, hidden_size=16, num_attention_heads=2, projection_dim=16,
                       hidden_act="quick_gelu")
        save_tiny_clip(parts / "te2", with_projection=True, seed=seed + 1, hidden_size=16, num_attention_heads=2,
                       projection_dim=16, hidden_act="gelu")
        save_tiny_tokenizer(parts / "tok")
        save_tiny_tokenizer(parts / "tok2", pad_token="!")
    else:
        act = "gelu" if kind == "sd2" else "quick_gelu"
        save_tiny_clip(parts / "te", seed=seed, hidden_act=act)
        save_tiny_tokenizer(parts / "tok")
    refiner = dict(cross_attention_dim=16, projection_class_embeddings_input_dim=16 + 5 * 8)
    save_tiny_unet_condition(parts / "unet", kind="sdxl" if kind == "sdxl-refiner" else kind, seed=seed,
                             **(refiner if kind == "sdxl-refiner" else {}))
    save_tiny_vae(parts / "vae", seed=seed)
    torch.manual_seed(seed)
    common = dict(vae=AutoencoderKL.from_pretrained(parts / "vae"),
                  unet=UNet2DConditionModel.from_pretrained(parts / "unet"))
    if kind != "sdxl-refiner":
        common["tokenizer"] = CLIPTokenizer.from_pretrained(str(parts / "tok"))
    if kind == "sdxl-refiner":
        pipe = StableDiffusionXLImg2ImgPipeline(
            text_encoder=None, tokenizer=None,
            text_encoder_2=CLIPTextModelWithProjection.from_pretrained(parts / "te2"),
            tokenizer_2=CLIPTokenizer.from_pretrained(str(parts / "tok2")),
            scheduler=EulerDiscreteScheduler(**SCHEDULER), requires_aesthetics_score=True,
            force_zeros_for_empty_prompt=False, add_watermarker=False, **common)
    elif kind == "sdxl":
        pipe = StableDiffusionXLPipeline(
            text_encoder=CLIPTextModel.from_pretrained(parts / "te"),
            text_encoder_2=CLIPTextModelWithProjection.from_pretrained(parts / "te2"),
            tokenizer_2=CLIPTokenizer.from_pretrained(str(parts / "tok2")),
            scheduler=EulerDiscreteScheduler(**SCHEDULER), add_watermarker=False, **common)
    else:
        pred = "v_prediction" if kind == "sd2" else "epsilon"
        pipe = StableDiffusionPipeline(
            text_encoder=CLIPTextModel.from_pretrained(parts / "te"),
            scheduler=DDIMScheduler(**SCHEDULER, **DDIM_EXTRA, prediction_type=pred), safety_checker=None,
            feature_extractor=None, requires_safety_checker=False, **common)
    pipe.save_pretrained(directory)
    # The published folders hold the four tokenizer files; diffusers (through transformers 5) writes
    # tokenizer.json instead. Put the published files back so both layouts are what we load.
    for tok, sub in (("tok", "tokenizer"), ("tok2", "tokenizer_2")):
        if (parts / tok).is_dir():
            for f in (parts / tok).iterdir():
                (directory / sub / f.name).write_bytes(f.read_bytes())
    return directory


def reference_pipeline(folder: Path, sampler: str) -> Any:
    """diffusers' own pipeline for ``folder`` with the scheduler preheat maps ``sampler`` to."""
    from diffusers import DiffusionPipeline

    from preheat.backends.torch.sampling import make_scheduler
    from preheat.backends.torch.text import restore_text_model

    pipe = DiffusionPipeline.from_pretrained(folder)
    restore_text_model(pipe)  # diffusers' SD clip_skip on transformers >= 5.6 (diffusers#14124)
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    pipe.scheduler = make_scheduler(sampler, config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_pixels(pipe: Any, prompt: Any, noise: np.ndarray, **kwargs: Any) -> np.ndarray:
    """diffusers' images (uint8, NHWC) from the given NCHW standard-normal latents."""
    import torch

    with torch.no_grad():
        out = pipe(prompt=prompt, latents=torch.from_numpy(noise), output_type="np", **kwargs).images
    return (np.asarray(out) * 255).round().astype(np.uint8)  # diffusers' numpy_to_pil rounding
