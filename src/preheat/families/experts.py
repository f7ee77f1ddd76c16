"""SDXL's ensemble of experts: the base denoises the high-noise steps, a refiner the rest.

A base SDXL model loaded with ``refiner=FOLDER`` (an SDXL refiner's folder,
stabilityai/stable-diffusion-xl-refiner-1.0) runs diffusers' two-pipeline recipe as one call::

    latents = base(prompt, denoising_end=f, output_type="latent")           # steps t >= cutoff
    image = refiner(prompt, image=latents, denoising_start=f)               # the rest, no noise added

and declares, beside the base's inputs::

    input                      static / data      reaches
    -------------------------  -----------------  ----------------------------------------------
    denoising_end (0.8)        data (n,) float32  the step the refiner takes over at: the base keeps
                                                  the timesteps >= round(T - f T), as diffusers
    aesthetic_score (6.0),     data (time ids)    the refiner's time ids (with the call's
      negative_aesthetic_score                    original_size and crop), as its img2img pipeline
      (2.5)

One program serves every fraction: the handoff is the timestep halfway between the last step the
base runs and the first the refiner runs (``refiner_cutoff``, data), the denoiser picks its expert
per step with ``lax.cond``, and the solver starts afresh there (``Family.restart_step``), as the
refiner pipeline's own scheduler does. The refiner reads its own text encoder (the prompt, the
negative prompt; its folder's ``force_zeros_for_empty_prompt``; a second encode stage beside the
base's) and no LoRA; the base's VAE decodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from preheat.errors import InvalidArgumentError, UnsupportedConfigError
from preheat.families.base import EngineView, Request
from preheat.families.inputs import Float, InputSpec

__all__ = ["DENOISING_END", "AESTHETIC_SCORE", "NEGATIVE_AESTHETIC_SCORE", "REFINER_SPECS", "REFINER_NAMES",
           "IMAGE_INPUTS", "refuse_without_refiner",
           "refuse_image_inputs_with_refiner", "check_refiner", "handoff", "check_handoff", "cutoff_leaf", "by_expert"]

DENOISING_END = InputSpec("denoising_end", Float(0.0, 1.0), "The share of the denoising the base model does before "
                          "the refiner takes over (1: the base alone).", default=0.8)
# An SDXL refiner's micro-conditioning (model_index requires_aesthetics_score): the aesthetic score in place of
# the target size, diffusers' defaults; data, as the sizes. The refiner's own folder declares them too.
AESTHETIC_SCORE = InputSpec("aesthetic_score", Float(), "SDXL refiner: the aesthetic score the image is conditioned "
                            "on (its time ids' last value).", default=6.0)
NEGATIVE_AESTHETIC_SCORE = InputSpec("negative_aesthetic_score", Float(), "SDXL refiner: the unconditional branch's "
                                     "aesthetic score.", default=2.5, needs_guidance=True)
REFINER_SPECS = (DENOISING_END, AESTHETIC_SCORE, NEGATIVE_AESTHETIC_SCORE)  # what a base with a refiner adds
REFINER_NAMES = tuple(s.name for s in REFINER_SPECS)
# what a base with a refiner does not declare: img2img and inpainting (``families.image``)
IMAGE_INPUTS = ("image", "mask_image", "strength", "padding_mask_crop")

_FAR = np.float32(1e9)  # beyond any timestep


def refuse_without_refiner(inputs: Mapping[str, Any], declared: tuple[str, ...]) -> None:
    """A refiner input given to a base loaded without one (the family does not ``declared`` it: a
    refiner's own folder takes its aesthetic scores): one line saying how to load it."""
    given = [name for name in REFINER_NAMES if inputs.get(name) is not None and name not in declared]
    if given:
        raise InvalidArgumentError(f"{given[0]} needs a refiner: load the model with refiner=FOLDER "
                                   "(preheat sample/serve --refiner FOLDER)", argument=given[0])


def refuse_image_inputs_with_refiner(inputs: Mapping[str, Any]) -> None:
    """img2img and inpainting beside a refiner: not declared (the ensemble starts from noise), and
    refused in one line saying so."""
    given = [name for name in IMAGE_INPUTS if inputs.get(name) is not None]
    if given:
        raise InvalidArgumentError(f"{given[0]} is not supported with a refiner yet (the ensemble of experts starts "
                                   "from noise); load the refiner alone to refine an image", argument=given[0])


def check_refiner(root: Path, family: Any, inpaint: bool, control: bool) -> None:
    """An SDXL refiner folder beside an SDXL base's text-to-image UNet, without a ControlNet (before
    any weight is read); else one line."""
    from preheat.models.safetensors_files import read_json

    if not family.xl or family.aesthetics or inpaint or control:
        kind = ("an SDXL refiner" if family.aesthetics else "an inpainting UNet" if inpaint else
                "a ControlNet" if control else "a Stable Diffusion 1.x/2.x model")
        raise UnsupportedConfigError(f"refiner={root}: a refiner with {kind} is not supported (an SDXL base's "
                                     "text-to-image only)")
    index = read_json(root / "model_index.json", "pipeline index")
    if not (index.get("_class_name", "").startswith("StableDiffusionXL") and index.get("requires_aesthetics_score")):
        raise UnsupportedConfigError(f"refiner={root} is not an SDXL refiner (its model_index.json has no "
                                     "requires_aesthetics_score)")


def handoff(pipe: EngineView, request: Request) -> tuple[int, np.ndarray]:
    """(the step the refiner starts at, the model timesteps of the call's steps (steps,))."""
    from preheat.families import request as request_of
    from preheat.samplers import handoff_step

    config = request_of.scheduler_config(pipe, request)
    plan = request_of.plan(pipe, request)
    t = np.asarray(plan.timesteps[:int(plan.n_steps)], np.float64)
    return handoff_step(plan, config.num_train_timesteps or 1000, request.values["denoising_end"]), t


def check_handoff(pipe: EngineView, request: Request) -> int:
    """The handoff step, or one line for a sampler whose steps diffusers' second pipeline would
    count otherwise (two model calls a step). A fraction that leaves the base no step runs the
    refiner alone from the noise, as diffusers' recipe then does."""
    from preheat.families import request as request_of
    from preheat.samplers import make_spec

    step, t = handoff(pipe, request)
    spec = make_spec(request_of.scheduler_config(pipe, request), request.sampler)
    if 0 < step < len(t) and (spec.max_model_calls_per_step > 1 or not np.all(np.diff(t) < 0)):
        raise InvalidArgumentError(f"sampler {request.sampler!r} cannot hand over to the refiner part-way (it calls "
                                   "the model twice a step, or twice at one timestep); use another, or "
                                   "denoising_end=1", argument="sampler")
    return step


def cutoff_leaf(pipe: EngineView, request: Request) -> np.ndarray:
    """(n,) float32: the timestep between the base's last step and the refiner's first; the base
    denoises at timesteps above it (all of them when it runs every step, none when it runs none)."""
    step, t = handoff(pipe, request)
    cutoff = -_FAR if step >= len(t) else _FAR if step == 0 else (t[step - 1] + t[step]) / 2
    return np.full((request.n,), cutoff, np.float32)


def by_expert(t: Any, cutoff: Any, base: Callable[[Any], Any], refiner: Callable[[Any], Any], x: Any) -> Any:
    """Inside the program: the base's prediction above the cutoff, the refiner's below (one runs)."""
    import jax

    return jax.lax.cond(t[0] > cutoff[0], base, refiner, x)  # one timestep per call: every image's the same
