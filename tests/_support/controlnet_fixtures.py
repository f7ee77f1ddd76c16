"""Tiny random-weight diffusers ``ControlNetModel`` folders, made from a tiny UNet (``from_unet``).

``ControlNetModel.from_unet`` copies the UNet's down half and starts every zero conv (and the
control embedding's conv_out) at zero; the weights are then perturbed, so that a residual mapped
to the wrong skip, or a zero conv dropped, changes the output. The control embedding is
(16, 32): one stride-2 conv, the tiny VAE's factor of 2 (a 32x32 image for 16x16 latents).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests._support.unet_condition_fixtures import perturb_

EMBEDDING = (16, 32)


def save_tiny_controlnet(directory: str | Path, unet_folder: str | Path, *, seed: int = 0, perturb: float = 0.05,
                         zero_convs: float = 0.2, global_pool_conditions: bool = False, **options: Any) -> Path:
    """A ControlNetModel folder (``save_pretrained``) for the UNet in ``unet_folder`` (a UNet folder
    or a pipeline folder's ``unet/``); ``options``: ``from_unet``'s (channel order, ...); ``zero_convs``: the
    extra noise on the zero convs; ``global_pool_conditions``: the shuffle ControlNet's config flag (each
    residual averaged over the image; diffusers' pipelines then run guess mode). Returns it."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    unet_folder = Path(unet_folder)
    if (unet_folder / "unet").is_dir():
        unet_folder = unet_folder / "unet"
    torch.manual_seed(seed)
    unet = UNet2DConditionModel.from_pretrained(unet_folder)
    model = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=EMBEDDING, **options).eval()
    perturb_(model, perturb, seed + 7)
    gen = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():  # the zero convs further from zero: residuals that move a tiny pipeline's pixels
        zeroed = ("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding.conv_out")
        for name, p in model.named_parameters():
            if name.startswith(zeroed):
                p.add_(torch.randn(p.shape, generator=gen) * zero_convs)
    if global_pool_conditions:
        model.register_to_config(global_pool_conditions=True)
    model.save_pretrained(directory)
    return Path(directory)


def control_image(height: int = 32, width: int = 32, seed: int = 0) -> np.ndarray:
    """A uint8 (H, W, 3) control image: edges of random blocks, as an edge map would look."""
    rng = np.random.default_rng(seed)
    image = np.zeros((height, width, 3), np.uint8)
    for _ in range(6):
        top, left = rng.integers(0, height - 4), rng.integers(0, width - 4)
        h, w = rng.integers(3, height // 2), rng.integers(3, width // 2)
        image[top:top + h, left:left + w] = rng.integers(64, 256, size=3, dtype=np.uint8)
    return image


def reference_controlnet_pipeline(folder: Path, controlnet_folder: Path, sampler: str) -> Any:
    """diffusers' StableDiffusion[XL]ControlNetPipeline of ``folder``'s components and the
    ControlNet, with the scheduler preheat maps ``sampler`` to (``sd_fixtures.reference_pipeline``)."""
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionXLControlNetPipeline

    from tests._support.sd_fixtures import reference_pipeline

    base = reference_pipeline(Path(folder), sampler)
    components = dict(base.components, controlnet=ControlNetModel.from_pretrained(controlnet_folder).eval())
    if "text_encoder_2" in components:
        components = {k: v for k, v in components.items() if k not in ("image_encoder", "feature_extractor")}
        pipe = StableDiffusionXLControlNetPipeline(**components, add_watermarker=False)
    else:
        components = {k: v for k, v in components.items() if k not in ("image_encoder",)}
        pipe = StableDiffusionControlNetPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# diffusers' ControlNet pipelines that start from an image: (kind, inpaint) -> class name
IMAGE_CLASS = {("sd1", False): "StableDiffusionControlNetImg2ImgPipeline",
               ("sd1", True): "StableDiffusionControlNetInpaintPipeline",
               ("sdxl", False): "StableDiffusionXLControlNetImg2ImgPipeline",
               ("sdxl", True): "StableDiffusionXLControlNetInpaintPipeline"}


def reference_controlnet_image_pipeline(folder: Path, controlnet_folder: Path, kind: str, sampler: str,
                                        inpaint: bool) -> Any:
    """diffusers' ControlNet img2img (or inpaint) pipeline of ``folder``'s components (an
    ``image_fixtures`` folder: 4 or 9 UNet channels) and the ControlNet, with the scheduler preheat
    maps ``sampler`` to."""
    import diffusers
    from diffusers import ControlNetModel

    from tests._support.sd_fixtures import reference_pipeline

    base = reference_pipeline(Path(folder), sampler)
    cls = getattr(diffusers, IMAGE_CLASS[kind, inpaint])
    components = {k: v for k, v in base.components.items() if k in cls._get_signature_keys(cls)[0]}
    components["controlnet"] = ControlNetModel.from_pretrained(controlnet_folder).eval()
    if kind == "sdxl":
        components["add_watermarker"] = False
    else:
        components["safety_checker"], components["feature_extractor"] = None, None
        components["requires_safety_checker"] = False
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe
