"""Tiny random-weight diffusers AutoencoderKL folders, built with diffusers itself (for VAE and pipeline tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# As small as diffusers' own pipeline tests: two levels (x2 downscale), 32 px images -> 16 px latents.
TINY_VAE: dict[str, Any] = dict(
    in_channels=3, out_channels=3, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
    latent_channels=4, sample_size=32,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
)


def tiny_vae_config(**overrides: Any) -> dict[str, Any]:
    """TINY_VAE with ``overrides``; a changed ``block_out_channels`` resizes the block-type lists to match."""
    config = {**TINY_VAE, **overrides}
    n = len(config["block_out_channels"])
    if "down_block_types" not in overrides:
        config["down_block_types"] = ("DownEncoderBlock2D",) * n
    if "up_block_types" not in overrides:
        config["up_block_types"] = ("UpDecoderBlock2D",) * n
    return config


def torch_vae(seed: int = 0, perturb: float = 0.05, **overrides: Any):
    """A random-weight diffusers AutoencoderKL (eval mode, fp32).

    ``perturb`` adds noise to every parameter so that norms (initialised to 1/0) and zero biases
    cannot hide a layout bug.
    """
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    model = AutoencoderKL(**tiny_vae_config(**overrides)).eval()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * perturb)
    return model


def save_tiny_vae(directory: str | Path, seed: int = 0, perturb: float = 0.05, variant: str | None = None,
                  max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a tiny random AutoencoderKL with ``save_pretrained`` into ``directory`` and return it.

    ``overrides`` are AutoencoderKL config values (``latent_channels=16, shift_factor=0.1159``...).
    ``variant="fp16"`` writes ``diffusion_pytorch_model.fp16.safetensors`` in float16;
    ``max_shard_size`` (e.g. ``"40KB"``) writes a sharded checkpoint with an index.
    """
    import torch

    directory = Path(directory)
    model = torch_vae(seed=seed, perturb=perturb, **overrides)
    if variant == "fp16":
        model = model.to(torch.float16)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if variant:
        kwargs["variant"] = variant
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **kwargs)
    return directory


def nchw(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(x, (0, 3, 1, 2)))


def nhwc(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(x, (0, 2, 3, 1)))
