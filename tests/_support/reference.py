"""Shared helpers that build independent references with diffusers (torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests._support.shared_folders import built_once

# Architectures of published checkpoints (diffusers config.json), with sample_size reduced where noted.
DDPM_CIFAR10_32: dict[str, Any] = dict(  # google/ddpm-cifar10-32 (35.7 M parameters)
    sample_size=32, in_channels=3, out_channels=3, layers_per_block=2,
    block_out_channels=(128, 256, 256, 256),
    down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=None, norm_eps=1e-6, norm_num_groups=32, act_fn="silu",
    flip_sin_to_cos=False, freq_shift=1, downsample_padding=0, center_input_sample=False,
    mid_block_scale_factor=1, time_embedding_type="positional",
)
DDPM_CHURCH_256_AT_32: dict[str, Any] = dict(  # google/ddpm-church-256 / celebahq-256, 6 levels, at 32 px
    # its layout and options at a quarter of its widths (128 ... 512): ddpm-cifar10-32 is the
    # full-width UNet2DModel check; what this one adds is the 6-level layout and church's options
    sample_size=32, in_channels=3, out_channels=3, layers_per_block=2,
    block_out_channels=(32, 32, 64, 64, 128, 128),
    down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"),
    attention_head_dim=None, norm_eps=1e-6, norm_num_groups=32, act_fn="silu",
    flip_sin_to_cos=False, freq_shift=1, downsample_padding=0, center_input_sample=False,
    mid_block_scale_factor=1, time_embedding_type="positional",
)
BUTTERFLIES_AT_32: dict[str, Any] = dict(  # diffusers training tutorial UNet (128 px), at 32 px
    # its block layout at a quarter of its widths: what it adds to ddpm-church-256 (the same
    # layout) is diffusers' defaults (eps, sin/cos order, shift, padding, heads)
    sample_size=32, in_channels=3, out_channels=3, layers_per_block=2,
    block_out_channels=(32, 32, 64, 64, 128, 128),
    down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"),
)
CLASS_CONDITIONAL: dict[str, Any] = dict(
    sample_size=16, in_channels=1, out_channels=1, layers_per_block=1,
    block_out_channels=(32, 64), norm_num_groups=8, attention_head_dim=16,
    down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    num_class_embeds=11,
)
SCALE_SHIFT_HEADS: dict[str, Any] = dict(
    sample_size=16, in_channels=3, out_channels=3, layers_per_block=2,
    block_out_channels=(32, 64, 64), norm_num_groups=16, attention_head_dim=8,
    down_block_types=("AttnDownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D", "AttnUpBlock2D"),
    resnet_time_scale_shift="scale_shift",
)


def save_random_unet(config: dict[str, Any], path: Path, seed: int = 0, perturb: float = 0.0) -> Path:
    """A random-weight diffusers UNet2DModel saved with save_pretrained.

    ``perturb`` adds noise to every parameter: diffusers zero-initialises some layers (e.g. none
    here, but norms start at 1/0), and identical-looking weights would let layout bugs hide.
    """
    import torch
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    model = UNet2DModel(**config).eval()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * perturb)
    model.save_pretrained(path)
    return path


def torch_unet_output(path: Path, x: np.ndarray, t: np.ndarray, class_labels: np.ndarray | None = None) -> np.ndarray:
    import torch
    from diffusers import UNet2DModel

    model = UNet2DModel.from_pretrained(path).eval()
    with torch.no_grad():
        y = None if class_labels is None else torch.from_numpy(class_labels)
        return model(torch.from_numpy(x), torch.from_numpy(t), class_labels=y).sample.numpy()


TINY_CLASS_CONDITIONAL: dict[str, Any] = dict(
    sample_size=8, in_channels=1, out_channels=1, layers_per_block=1, block_out_channels=(8, 16),
    norm_num_groups=4, attention_head_dim=8, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D"), num_class_embeds=11,
)


@built_once  # written once per run, copied to each caller (tests/_support/shared_folders.py)
def save_tiny_pipeline(path: Path, seed: int = 0, config: dict[str, Any] | None = None) -> Path:
    """A tiny class-conditional pipeline folder shaped like the built-in model (null class 10)."""
    import json

    from preheat.train.digits import DIGITS_SCHEDULER

    save_random_unet(config or TINY_CLASS_CONDITIONAL, path / "unet", seed=seed, perturb=0.05)
    (path / "scheduler").mkdir(parents=True, exist_ok=True)
    (path / "scheduler" / "scheduler_config.json").write_text(json.dumps(DIGITS_SCHEDULER))
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": "DDPMPipeline",
        "preheat": {"null_class": 10, "labels": [str(i) for i in range(10)],
                    "defaults": {"sampler": "dpmpp_2m", "steps": 4, "guidance": 2.0}},
    }))
    return path
