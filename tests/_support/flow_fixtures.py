"""Tiny random-weight FLUX.1 (schnell, dev) and SD3 pipeline folders, written by diffusers.

Each folder is a real ``FluxPipeline`` / ``StableDiffusion3Pipeline`` saved with
``save_pretrained`` (diffusers' own ``model_index.json``), at the scale of diffusers' pipeline
tests: one or two layers, small heads, small RoPE axes; 32x32 images, 16x16 latents (a two-level
VAE), 16-channel-style latents with ``shift_factor``. The scheduler configs are the published
ones (FLUX.1-dev: dynamic shifting; schnell: shift 1; SD3: shift 3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests._support.shared_folders import built_once
from tests._support.t5_fixtures import save_tiny_t5_encoder, save_tiny_t5_tokenizer
from tests._support.text_fixtures import save_tiny_clip, save_tiny_tokenizer
from tests._support.vae_fixtures import save_tiny_vae

KINDS = ("flux-schnell", "flux-dev", "flux-kontext", "sd3")
FLUX_SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
                  "num_train_timesteps": 1000}
SCHEDULERS = {
    "flux-schnell": {**FLUX_SCHEDULER, "shift": 1.0, "use_dynamic_shifting": False},
    "flux-dev": {**FLUX_SCHEDULER, "shift": 3.0, "use_dynamic_shifting": True},
    "flux-kontext": {**FLUX_SCHEDULER, "shift": 3.0, "use_dynamic_shifting": True},
    "flux-fill": {**FLUX_SCHEDULER, "shift": 3.0, "use_dynamic_shifting": True},
    "sd3": {"num_train_timesteps": 1000, "shift": 3.0},
}
# the latent statistics of the published 16-channel VAEs (FLUX.1: 0.3611 / 0.1159; SD3: 1.5305 / 0.0609)
VAE_STATS = {"flux": dict(scaling_factor=0.3611, shift_factor=0.1159),
             "sd3": dict(scaling_factor=1.5305, shift_factor=0.0609)}


@built_once  # written once per run, copied to each caller (tests/_support/shared_folders.py)
def save_tiny_flow_model(directory: str | Path, kind: str = "flux-dev", seed: int = 0, t5: bool = True,
                         quiet_posterior: bool = False, latent_channels: int = 4,
                         transformer_config: dict[str, Any] | None = None) -> Path:
    """A whole tiny pipeline folder of ``kind`` ("flux-schnell", "flux-dev", "flux-kontext": a
    ``FluxKontextPipeline``, "flux-fill": a ``FluxFillPipeline``, whose transformer takes the
    masked image's and the mask's channels too, "sd3"; ``t5=False``: an SD3 folder without its
    third encoder).

    ``quiet_posterior``: the VAE posterior's variance is negligible (the encoder's logvar half:
    weight 0, bias -30, so std = e^-15), so that diffusers' img2img, which samples it with its
    generator, and preheat, with its seeds, both give the mean; how either samples is unchanged.
    ``latent_channels`` (SD3 only): 16 as the published VAE, which ``StableDiffusion3InpaintPipeline``
    requires of a base transformer. ``transformer_config`` (SD3 only): more ``SD3Transformer2DModel``
    keywords, e.g. ``qk_norm="rms_norm"`` as SD3.5 Large's (and its Turbo's)."""
    import torch
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxFillPipeline, FluxKontextPipeline,
                           FluxPipeline, FluxTransformer2DModel, SD3Transformer2DModel, StableDiffusion3Pipeline)
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

    directory = Path(directory)
    parts = directory.parent / f".{directory.name}-parts"
    flux = kind.startswith("flux")
    if flux and (latent_channels != 4 or transformer_config):
        raise ValueError("latent_channels and transformer_config apply to SD3 folders only")
    vae_overrides = dict(latent_channels=latent_channels, use_quant_conv=False, use_post_quant_conv=False,
                         **VAE_STATS["flux" if flux else "sd3"])
    save_tiny_vae(parts / "vae", seed=seed, **vae_overrides)
    if quiet_posterior:
        _quiet_posterior(parts / "vae")
    save_tiny_tokenizer(parts / "tok")
    save_tiny_t5_tokenizer(parts / "tok_t5", layout="hub")
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULERS[kind])
    torch.manual_seed(seed)
    if flux:
        save_tiny_clip(parts / "te", seed=seed, hidden_act="gelu")  # hidden 32 = pooled_projection_dim
        save_tiny_t5_encoder(parts / "t5", seed=seed + 1)  # d_model 32 = joint_attention_dim
        # Fill: 4 x (4 noise + 4 masked-image + 2 x 2 mask) channels in, the noise's 16 out (the VAE's factor is 2)
        fill = dict(in_channels=48, out_channels=16) if kind == "flux-fill" else dict(in_channels=16)
        transformer = FluxTransformer2DModel(
            patch_size=1, num_layers=1, num_single_layers=1, attention_head_dim=16, **fill,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
            guidance_embeds=kind != "flux-schnell")
        _perturb(transformer)
        pipe = {"flux-kontext": FluxKontextPipeline, "flux-fill": FluxFillPipeline}.get(kind, FluxPipeline)(
            scheduler=scheduler, vae=AutoencoderKL.from_pretrained(parts / "vae"),
            text_encoder=CLIPTextModel.from_pretrained(parts / "te"),
            tokenizer=CLIPTokenizer.from_pretrained(str(parts / "tok")),
            text_encoder_2=T5EncoderModel.from_pretrained(parts / "t5"),
            tokenizer_2=T5TokenizerFast.from_pretrained(str(parts / "tok_t5")), transformer=transformer)
    else:
        save_tiny_clip(parts / "te", with_projection=True, seed=seed, hidden_act="gelu", projection_dim=32)
        save_tiny_clip(parts / "te2", with_projection=True, seed=seed + 1, hidden_act="gelu", projection_dim=32)
        save_tiny_tokenizer(parts / "tok2", pad_token="!")
        if t5:
            save_tiny_t5_encoder(parts / "t5", seed=seed + 2, d_model=64)
        transformer = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=latent_channels, num_layers=2, attention_head_dim=8,
            num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=64, pooled_projection_dim=64,
            out_channels=latent_channels, pos_embed_max_size=16, **(transformer_config or {}))
        _perturb(transformer)
        pipe = StableDiffusion3Pipeline(
            scheduler=scheduler, vae=AutoencoderKL.from_pretrained(parts / "vae"), transformer=transformer,
            text_encoder=CLIPTextModelWithProjection.from_pretrained(parts / "te"),
            tokenizer=CLIPTokenizer.from_pretrained(str(parts / "tok")),
            text_encoder_2=CLIPTextModelWithProjection.from_pretrained(parts / "te2"),
            tokenizer_2=CLIPTokenizer.from_pretrained(str(parts / "tok2")),
            text_encoder_3=T5EncoderModel.from_pretrained(parts / "t5") if t5 else None,
            tokenizer_3=T5TokenizerFast.from_pretrained(str(parts / "tok_t5")) if t5 else None)
    pipe.save_pretrained(directory)
    # Published folders hold the hub tokenizer files; put them back over what transformers 5 wrote.
    for tok, sub in (("tok", "tokenizer"), ("tok2", "tokenizer_2"), ("tok_t5", "tokenizer_2" if flux else "tokenizer_3")):
        if (parts / tok).is_dir() and (directory / sub).is_dir():
            for f in (parts / tok).iterdir():
                (directory / sub / f.name).write_bytes(f.read_bytes())
    return directory


def picture(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A smooth uint8 (H, W, 3) picture to start from or edit: gradients, a wave and a little noise
    (a VAE sees structure, not white noise)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, 0.5 + 0.5 * np.sin((x + y) / 5)], axis=-1) * 255
    return np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)


def _quiet_posterior(folder: Path) -> None:
    import torch
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(folder)
    half = vae.config.latent_channels
    moments = vae.quant_conv if vae.quant_conv is not None else vae.encoder.conv_out  # -> (mean, logvar)
    with torch.no_grad():
        moments.weight[half:] = 0.0
        moments.bias[half:] = -30.0
    vae.save_pretrained(folder)


def replayed_noise(shape: tuple[int, ...], seeds: Any, draws_before: int = 1) -> np.ndarray:
    """The ε (n, C, h, w) diffusers' img2img draws from one generator per seed after
    ``draws_before`` draws of ``shape`` (1: the image's posterior sample)."""
    import torch

    out = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(int(seed))
        for _ in range(draws_before):
            torch.randn(shape, generator=gen)
        out.append(torch.randn(shape, generator=gen).numpy())
    return np.concatenate(out) if out else np.zeros((0, *shape[1:]), np.float32)


def _perturb(model: Any, scale: float = 0.05) -> None:
    """Noise on every weight: zero-initialised AdaLN and output layers would hide a mapping bug."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def reference_pipeline(folder: Path, sampler: str = "flow_euler") -> Any:
    """diffusers' own pipeline for ``folder`` with the scheduler preheat maps ``sampler`` to."""
    from diffusers import DiffusionPipeline

    from preheat.backends.torch.sampling import make_scheduler

    index = json.loads((folder / "model_index.json").read_text())
    absent = {k: None for k, v in index.items() if v == [None, None]}  # e.g. SD3 saved without T5
    pipe = DiffusionPipeline.from_pretrained(folder, **absent)
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    pipe.scheduler = make_scheduler(sampler, config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_pixels(pipe: Any, prompt: Any, noise: np.ndarray, **kwargs: Any) -> np.ndarray:
    """diffusers' uint8 NHWC images from NCHW standard-normal latents (packed first for Flux)."""
    import torch

    latents = torch.from_numpy(noise)
    if type(pipe).__name__.startswith("Flux"):
        b, c, h, w = latents.shape
        latents = pipe._pack_latents(latents, b, c, h, w)
    with torch.no_grad():
        out = pipe(prompt=prompt, latents=latents, output_type="np", height=noise.shape[2] * pipe.vae_scale_factor,
                   width=noise.shape[3] * pipe.vae_scale_factor, **kwargs).images
    return (np.asarray(out) * 255).round().astype(np.uint8)
