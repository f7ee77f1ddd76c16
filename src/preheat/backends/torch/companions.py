"""The torch backend's second model folders (``preheat.load(model, backend="torch", controlnet= | refiner=)``):
diffusers' own ControlNet pipelines and SDXL's two-pipeline ensemble of experts, on the inputs the
JAX family declares for them (``preheat.families.control``, ``preheat.families.experts``).

    controlnet=FOLDER   ControlNetModel.from_pretrained(FOLDER) beside the loaded pipeline's components:
                        StableDiffusion[XL]ControlNet[Img2Img|Inpaint]Pipeline (``from_pipe``: no weights
                        copied), the control image as PIL with the call's width x height, which diffusers'
                        control_image_processor resizes (lanczos) and scales to [0, 1] as the JAX engine does
    refiner=FOLDER      StableDiffusionXLImg2ImgPipeline.from_pretrained(FOLDER, vae=base.vae): the base to
                        ``denoising_end`` (output_type="latent"), the refiner on from those latents
                        (``denoising_start``), each with a fresh scheduler of the call's sampler

Both are checked as the JAX loader checks them (the same functions: a ControlNet that does not fit
the UNet, a refiner beside what it cannot follow, schedules that differ are one line) before their
weights are read. The extra model is compiled with the denoiser (``compile=``): its fingerprint joins
the denoiser's, so the compile cache keeps their entries apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from preheat.backends.torch.calls import diffusers_calls, size_ids
from preheat.errors import UnsupportedConfigError
from preheat.families.inputs import IMAGE_SIZE

__all__ = ["check_companions", "load_controlnet", "load_refiner", "control_pipeline", "control_kwargs",
           "refiner_kwargs", "refiner_runs"]


def check_companions(family: Any, root: Path, controlnet: Any, refiner: Any) -> None:
    """The families a second model folder applies to (the JAX loaders' keywords), in the JAX engine's words."""
    from preheat.load_options import companion_refused

    takes = {"controlnet": family.name in ("stable-diffusion", "stable-diffusion-xl", "stable-diffusion-xl-refiner"),
             "refiner": family.name in ("stable-diffusion-xl", "stable-diffusion-xl-refiner")}
    for name, folder in (("controlnet", controlnet), ("refiner", refiner)):
        if folder is not None and not takes[name]:
            raise companion_refused(name, root)


def load_controlnet(folder: Any, root: Path, family: Any, inpaint: bool, vae_scale: int, dtype: Any,
                    variant: str | None) -> tuple[Any, Any]:
    """(diffusers' ControlNetModel, preheat's ControlNetConfig) for ``folder`` beside the model in
    ``root``, after the JAX loader's fit checks on the configs alone."""
    from diffusers import ControlNetModel

    from preheat.families.sd_loading import check_controlnet
    from preheat.families.text import component
    from preheat.models.controlnet import read_controlnet_config, resolve_controlnet_dir
    from preheat.models.unet2d_condition import read_unet_condition_config

    cn_dir = resolve_controlnet_dir(folder)
    config = read_controlnet_config(cn_dir)
    index = json.loads((root / "model_index.json").read_text())
    unet = read_unet_condition_config(component(root, index, "unet"))
    check_controlnet(config, unet, family, inpaint, vae_scale, str(folder))
    model = ControlNetModel.from_pretrained(cn_dir, torch_dtype=dtype, **({"variant": variant} if variant else {}))
    return model.eval().requires_grad_(False), config


def load_refiner(folder: Any, base: Any, family: Any, inpaint: bool, control: bool, scheduler: Any, schedule: Any,
                 dtype: Any, variant: str | None) -> tuple[Any, Any]:
    """(diffusers' StableDiffusionXLImg2ImgPipeline of ``folder`` sharing ``base``'s VAE, the
    refiner's SDComponents) after the JAX loader's checks: an SDXL refiner beside an SDXL base's
    text-to-image UNet, of the base's ``schedule`` (its SchedulerConfig)."""
    from diffusers import StableDiffusionXLImg2ImgPipeline

    from preheat.families.components import SDComponents
    from preheat.families.experts import check_refiner
    from preheat.families.stable_diffusion import SDXL_REFINER
    from preheat.families.text import load_scheduler

    root = Path(folder)
    check_refiner(root, family, inpaint, control)
    own = load_scheduler(root, SDXL_REFINER, scheduler)[0]
    if own != schedule:
        raise UnsupportedConfigError(f"refiner={folder}: its scheduler config differs from the base's (the ensemble "
                                     "runs one schedule); give both the same")
    pipe = StableDiffusionXLImg2ImgPipeline.from_pretrained(str(root), vae=base.vae, torch_dtype=dtype,
                                                           **({"variant": variant} if variant else {}))
    if pipe.unet.config.in_channels != base.vae.config.latent_channels:
        raise UnsupportedConfigError(f"refiner={folder}: an inpainting refiner UNet is not supported")
    pipe.set_progress_bar_config(disable=True)
    encoder = pipe.text_encoder_2
    components = SDComponents(vae_scale=2 ** (len(base.vae.config.block_out_channels) - 1),
                              size_multiple=2 ** (len(base.vae.config.block_out_channels) - 1),
                              clip_layers=encoder.config.num_hidden_layers,
                              force_zeros=bool(pipe.config.get("force_zeros_for_empty_prompt", True)))
    return pipe, components


def control_pipeline(pipe: Any, family: str, values: dict[str, Any], controlnet: Any, cache: dict) -> Any:
    """diffusers' ControlNet pipeline for this call (text-to-image, img2img or inpaint) sharing
    ``pipe``'s components and the ControlNet (built once per kind)."""
    import diffusers

    kind = 0 if values.get("image") is None else 2 if values.get("mask_image") is not None else 1
    key = ("controlnet", family, kind)
    if key not in cache:
        calls = diffusers_calls(family)
        extra = {"requires_safety_checker": False} if calls.safety_checker else {}
        built = getattr(diffusers, calls.controlnet[kind]).from_pipe(pipe, controlnet=controlnet, **extra)
        built.set_progress_bar_config(disable=True)
        cache[key] = built
    out = cache[key]
    out.scheduler = pipe.scheduler  # this call's sampler
    return out


def control_kwargs(values: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's keywords (``image_kwargs``' for an image call) plus the declared control inputs, as
    diffusers' ControlNet pipelines name them: the control image is ``image`` in the text-to-image
    one, ``control_image`` beside an image. Always width x height, which its processors resize
    every image to, as the JAX engine does (``families.control.control_cond``)."""
    from PIL import Image

    out = {**kwargs, **IMAGE_SIZE.inputs(IMAGE_SIZE.of(values)),
           "controlnet_conditioning_scale": float(values["controlnet_conditioning_scale"]),
           "control_guidance_start": float(values["control_guidance_start"]),
           "control_guidance_end": float(values["control_guidance_end"])}
    out["image" if values.get("image") is None else "control_image"] = Image.fromarray(values["control_image"])
    return out


def refiner_runs(pipe: Any, request: Any) -> bool:
    """Whether the refiner takes any step: ``denoising_end`` below 1 (``experts.handoff``'s step
    inside the call). At 1 the base runs alone, as the JAX engine's; diffusers' refiner would
    take ``denoising_start=1`` as no handoff and refine the latents at its default strength."""
    from preheat.families.experts import check_handoff, handoff

    step = check_handoff(pipe, request)
    return step < len(handoff(pipe, request)[1])


def refiner_kwargs(values: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The refiner's keywords from the base's: the prompt and negative (its one encoder; no
    ``prompt_2``), the sampling ones, and its own time ids -- the family's ``refiner_time_ids``
    (the call's original size and crop, the aesthetic score), as the JAX engine conditions it."""
    keep = ("prompt", "negative_prompt", "num_inference_steps", "guidance_scale", "generator", "eta", "clip_skip",
            "guidance_rescale", "timesteps", "sigmas")
    out = {k: v for k, v in base.items() if k in keep}
    out.update(size_ids(values, "refiner_time_ids", "refiner_negative_time_ids"))
    out.update(denoising_start=float(values["denoising_end"]), output_type="np")
    return out
