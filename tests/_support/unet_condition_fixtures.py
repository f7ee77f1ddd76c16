"""Tiny random-weight diffusers ``UNet2DConditionModel`` folders, shaped like SD 1.x, SD 2.x and SDXL.

As small as diffusers' own pipeline tests (block_out_channels (32, 64), cross_attention_dim 32),
so that pipeline tests can build one in well under a second (once diffusers is imported). Also the published
full-size configs (SD 1.5, SD 2.1 768-v, SDXL base), for shape-only tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# SD 1.x: cross-attention on the first level, conv projection, attention_head_dim as an int (= heads).
TINY_SD1: dict[str, Any] = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=2, norm_num_groups=8,
)
# SD 2.x: linear projection, attention_head_dim as a list (heads per level), upcast attention.
TINY_SD2: dict[str, Any] = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=[2, 4], use_linear_projection=True, upcast_attention=True,
    norm_num_groups=8,
)
# SDXL: DownBlock2D first, text_time added embedding, two transformer layers on the second level.
TINY_SDXL: dict[str, Any] = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=32, attention_head_dim=[2, 4], use_linear_projection=True, transformer_layers_per_block=[1, 2],
    addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=16 + 6 * 8,
    norm_num_groups=8,
)
TINY = {"sd1": TINY_SD1, "sd2": TINY_SD2, "sdxl": TINY_SDXL}
TINY_POOLED_WIDTH = {"sdxl": 16}  # width of text_embeds that TINY_SDXL's projection expects

# Published configs (unet/config.json), keys that differ from diffusers' defaults.
SD15_UNET: dict[str, Any] = dict(  # runwayml/stable-diffusion-v1-5
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32, norm_eps=1e-5, act_fn="silu",
    flip_sin_to_cos=True, freq_shift=0, downsample_padding=1, mid_block_scale_factor=1, use_linear_projection=False,
    upcast_attention=None,
)
SD21_UNET: dict[str, Any] = dict(  # stabilityai/stable-diffusion-2-1 (768-v)
    sample_size=96, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=1024, attention_head_dim=[5, 10, 20, 20], use_linear_projection=True, upcast_attention=True,
    norm_num_groups=32, norm_eps=1e-5, flip_sin_to_cos=True, freq_shift=0, dual_cross_attention=False,
    only_cross_attention=False, resnet_time_scale_shift="default", mid_block_type="UNetMidBlock2DCrossAttn",
)
SDXL_BASE_UNET: dict[str, Any] = dict(  # stabilityai/stable-diffusion-xl-base-1.0
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=2048, attention_head_dim=[5, 10, 20], num_attention_heads=None,
    transformer_layers_per_block=[1, 2, 10], use_linear_projection=True, upcast_attention=None,
    addition_embed_type="text_time", addition_embed_type_num_heads=64, addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816, norm_num_groups=32, norm_eps=1e-5,
    mid_block_type="UNetMidBlock2DCrossAttn", conv_in_kernel=3, conv_out_kernel=3, class_embeddings_concat=False,
)


def perturb_(model: Any, scale: float, seed: int) -> None:
    """Add noise to every parameter, in place.

    diffusers starts norms at weight 1 / bias 0 and some biases at 0; a tensor mapped to the wrong
    place (or a bias dropped) would then go unnoticed.
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def tiny_config(kind: str = "sd1", **overrides: Any) -> dict[str, Any]:
    if kind not in TINY:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(TINY)}")
    return {**TINY[kind], **overrides}


def save_tiny_unet_condition(directory: str | Path, kind: str = "sd1", *, seed: int = 0, perturb: float = 0.05,
                             variant: str | None = None, **overrides: Any) -> Path:
    """A random-weight diffusers UNet2DConditionModel folder (``save_pretrained``); returns it.

    ``kind``: "sd1", "sd2" or "sdxl" (see TINY_*); ``overrides`` replace config keys.
    ``variant="fp16"`` saves ``diffusion_pytorch_model.fp16.safetensors`` in float16.
    """
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    model = UNet2DConditionModel(**tiny_config(kind, **overrides)).eval()
    if perturb:
        perturb_(model, perturb, seed)
    if variant == "fp16":
        model = model.half()
    model.save_pretrained(directory, variant=variant)
    return Path(directory)


def tiny_inputs(config: dict[str, Any], batch: int = 2, height: int = 8, width: int = 8, tokens: int = 7,
                seed: int = 0, pooled_width: int | None = None) -> dict[str, np.ndarray]:
    """Random NCHW sample, timesteps, text states and (for text_time) added ids, as numpy."""
    rng = np.random.RandomState(seed)
    out = {
        "sample": rng.randn(batch, config["in_channels"], height, width).astype(np.float32),
        "timestep": rng.randint(0, 1000, size=batch).astype(np.int64),
        "encoder_hidden_states": rng.randn(batch, tokens, config["cross_attention_dim"]).astype(np.float32),
    }
    if config.get("addition_embed_type") == "text_time":
        pooled = pooled_width or (config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"])
        out["text_embeds"] = rng.randn(batch, pooled).astype(np.float32)
        # (original h, w, crop top, crop left, target h, w), as SDXL pipelines build them
        out["time_ids"] = np.tile(np.array([[1024.0, 768.0, 0.0, 16.0, 1024.0, 1024.0]], np.float32), (batch, 1))
        out["time_ids"][:, 1] += np.arange(batch) * 64
    return out


def torch_output(model: Any, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """diffusers' UNet2DConditionModel output (NCHW numpy) for ``tiny_inputs``-style inputs."""
    import torch

    added = None
    if "text_embeds" in inputs:
        added = {"text_embeds": torch.from_numpy(inputs["text_embeds"]), "time_ids": torch.from_numpy(inputs["time_ids"])}
    with torch.no_grad():
        return model(torch.from_numpy(inputs["sample"]), torch.from_numpy(inputs["timestep"]),
                     encoder_hidden_states=torch.from_numpy(inputs["encoder_hidden_states"]),
                     added_cond_kwargs=added).sample.float().numpy()


def jax_output(unet: Any, inputs: dict[str, np.ndarray], jit: bool = True) -> np.ndarray:
    """preheat's output (NCHW numpy, float32) for the same inputs."""
    import jax
    import jax.numpy as jnp

    added = None
    if "text_embeds" in inputs:
        added = {"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]}
    def call(params, x, t, context, added):  # NCHW in and out; the weights an argument, not a constant
        out = unet.apply(params, jnp.transpose(x, (0, 2, 3, 1)).astype(unet.dtype), t, context.astype(unet.dtype),
                         added)
        return jnp.transpose(out, (0, 3, 1, 2)).astype(jnp.float32)

    call = jax.jit(call) if jit else call
    return np.asarray(call(unet.params, inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], added))
