"""A diffusers-style sampling loop in torch, with preheat's sampler names and pixel conversion."""

from __future__ import annotations

from typing import Any

import numpy as np

from preheat.samplers import DPM_FIXED_SETTINGS

__all__ = ["DIFFUSERS_SCHEDULERS", "make_scheduler", "sample_loop"]

# preheat sampler name -> (diffusers scheduler class, settings on top of the checkpoint's config). A dpm++
# sampler's are what its name fixes whatever the folder's config says (DPM_FIXED_SETTINGS: the JAX samplers
# read none of these keys from it), so both backends run the same solver.
DIFFUSERS_SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddpm": ("DDPMScheduler", {}),
    "ddim": ("DDIMScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", DPM_FIXED_SETTINGS["dpmpp_2m"]),
    "dpmpp_2m_karras": ("DPMSolverMultistepScheduler", DPM_FIXED_SETTINGS["dpmpp_2m_karras"]),
    "lcm": ("LCMScheduler", {}),
    "tcd": ("TCDScheduler", {}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "dpmpp_2m_sde": ("DPMSolverMultistepScheduler", DPM_FIXED_SETTINGS["dpmpp_2m_sde"]),
    "dpmpp_2m_sde_karras": ("DPMSolverMultistepScheduler", DPM_FIXED_SETTINGS["dpmpp_2m_sde_karras"]),
    "pndm": ("PNDMScheduler", {"skip_prk_steps": True}),
    "deis": ("DEISMultistepScheduler", {"algorithm_type": "deis", "solver_type": "logrho"}),  # its only ones
    "lms": ("LMSDiscreteScheduler", {}),
    "dpm2": ("KDPM2DiscreteScheduler", {}),
    "dpm2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    "dpmpp_sde": ("DPMSolverSDEScheduler", {}),  # its noise: a torchsde Brownian tree
    "dpmpp_2s": ("DPMSolverSinglestepScheduler", DPM_FIXED_SETTINGS["dpmpp_2s"]),
    "dpmpp_2s_karras": ("DPMSolverSinglestepScheduler", DPM_FIXED_SETTINGS["dpmpp_2s_karras"]),
    "flow_euler": ("FlowMatchEulerDiscreteScheduler", {}),
    "flow_heun": ("FlowMatchHeunDiscreteScheduler", {}),
    "edm_euler": ("EDMEulerScheduler", {}),
    "edm_dpmpp_2m": ("EDMDPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    "edm_dpmpp_2m_sde": ("EDMDPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
}


def make_scheduler(sampler: str, config: dict[str, Any]) -> Any:
    """The diffusers scheduler for ``sampler``, built from a scheduler_config.json dict."""
    import importlib.util

    import diffusers

    from preheat.errors import MissingExtraError, SchedulerConfigError

    if sampler not in DIFFUSERS_SCHEDULERS:
        raise SchedulerConfigError(f"unknown sampler {sampler!r}; supported: {', '.join(DIFFUSERS_SCHEDULERS)}")
    cls_name, extra = DIFFUSERS_SCHEDULERS[sampler]
    if sampler == "dpmpp_sde" and importlib.util.find_spec("torchsde") is None:  # diffusers' own stand-in says less
        raise MissingExtraError("torch", f"sampler {sampler!r} on the torch backend ({cls_name})", "torchsde")
    cls = getattr(diffusers, cls_name)
    clean = {k: v for k, v in config.items() if not k.startswith("_")}
    return cls.from_config({**clean, **extra})


def sample_loop(unet: Any, scheduler: Any, noise: Any, steps: int, *, class_labels: Any = None,
                guidance: float | None = None, null_class: int | None = None, eta: float = 0.0,
                generator: Any = None, timesteps: dict[str, Any] | None = None) -> np.ndarray:
    """Denoise ``noise`` (NCHW torch tensor, standard normal) -> uint8 pixels (B, H, W, C).

    The loop diffusers' pipelines run: ``set_timesteps``, ``init_noise_sigma``, and per step
    ``scale_model_input`` + model (+ classifier-free guidance) + ``step``. ``timesteps``: the
    call's own ``set_timesteps`` keywords (a card's custom ``timesteps=[...]``, which diffusers
    takes instead of the step count, as its pipelines' ``retrieve_timesteps`` passes them).
    """
    import inspect

    import torch

    guided = guidance is not None and guidance != 1.0
    scheduler.set_timesteps(**(timesteps or {"num_inference_steps": steps}))
    x = noise * scheduler.init_noise_sigma
    labels = class_labels
    if guided:
        labels = torch.cat([class_labels, torch.full_like(class_labels, null_class)])
    accepts = inspect.signature(scheduler.step).parameters
    step_kwargs: dict[str, Any] = {"eta": eta} if "eta" in accepts else {}
    if "generator" in accepts:  # Heun and DPM++ 2M are deterministic and take no generator
        step_kwargs["generator"] = generator
    with torch.no_grad():
        for t in scheduler.timesteps:
            x_in = scheduler.scale_model_input(x, t)
            if guided:
                out = unet(torch.cat([x_in, x_in]), t, class_labels=labels).sample
                cond, uncond = out.chunk(2)
                out = uncond + guidance * (cond - uncond)
            else:
                out = unet(x_in, t, class_labels=labels).sample
            x = scheduler.step(out, t, x, **step_kwargs).prev_sample
    images = (x / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
    return (images * 255).round().astype(np.uint8)
