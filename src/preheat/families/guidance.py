"""Guidance inputs beyond the scale, each declared once for the families whose diffusers pipelines
take it.

Guidance rescale: diffusers' ``guidance_rescale`` ("Common Diffusion Noise Schedules and Sample
Steps are Flawed", section 3.4), for SD 1.x / 2.x and SDXL (text-to-image, img2img and inpainting
run through the same families).

    input              value                          reaches
    -----------------  -----------------------------  ---------------------------------------------
    guidance_rescale   phi in [0, 1] (0: off, as      DenoiseArgs.guidance_rescale, () float32:
                       diffusers' default)            ``engine.rescaled_guidance`` after the CFG
                                                      combination, before the sampler's step

It reshapes classifier-free guidance's combination, so it is ``needs_guidance``: a call that runs
unguided refuses any value but the default 0. It is data: one program serves every value (0 selects
the plain combination exactly). A family that does not declare it, and every unguided call, gets
the program without it (``DenoiseArgs.guidance_rescale`` None).

True classifier-free guidance: diffusers' ``true_cfg_scale`` for FLUX.1 (``FluxPipeline`` and its
img2img, inpainting and Kontext pipelines). FLUX.1-dev's guidance scale is an input of the model
(embedded, one branch); a call that also gives a negative prompt and ``true_cfg_scale`` > 1 runs
the model on both and combines them as classifier-free guidance does, at that scale:

    input              value                          reaches
    -----------------  -----------------------------  ---------------------------------------------
    true_cfg_scale     > 1 with a negative prompt:    Request.cfg_scale -> DenoiseArgs.guidance, the
                       two branches (1: off)          combination's scale; the guidance scale stays
                                                      the model's embedded input, in both branches

Whether it runs is static (two branches: another program, as for every guided call); its value is
data. diffusers ignores a negative prompt without ``true_cfg_scale`` > 1 and warns about the reverse;
preheat refuses both in one line, as it refuses a negative prompt on an unguided SD call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from preheat.families.inputs import Float, InputSpec, ServerBound

if TYPE_CHECKING:
    from preheat.families.base import Request

__all__ = ["GUIDANCE_RESCALE", "guidance_rescale", "TRUE_CFG_SCALE", "true_cfg_scale"]

# diffusers' StableDiffusion[XL]Pipeline(..., guidance_rescale=0.7): the paper's phi (its Fig. 7: 0.7)
GUIDANCE_RESCALE = InputSpec("guidance_rescale", Float(0.0, 1.0), "Rescale the guided prediction's std toward the "
                             "prompt's (0: off; 0.7 as the paper), against over-exposure at high guidance.",
                             default=0.0, needs_guidance=True)


def guidance_rescale(request: Request) -> np.float32 | None:
    """The call's rescale as the denoising program takes it: a () float32 when classifier-free
    guidance runs and the family declares the input (its values hold it), else None (the program
    without the rescale: every other family's, and every unguided call's, is unchanged)."""
    value = request.values.get(GUIDANCE_RESCALE.name)
    if value is None or not request.guided:
        return None
    return np.float32(value)


# diffusers' FluxPipeline(..., true_cfg_scale=4.0, negative_prompt=...): its default 1.0 is off. It needs the
# negative prompt (warm-up's guided variant gives both); not warmed alone: any value > 1 is one program
TRUE_CFG_SCALE = InputSpec("true_cfg_scale", Float(0.0), "True classifier-free guidance against the negative prompt "
                           "(> 1: two model calls a step; the guidance scale stays the model's own input).",
                           default_doc="1 (off)", needs=("negative_prompt",), warm=(4.0,), bound=ServerBound.GUIDANCE)


def true_cfg_scale(values: dict[str, Any]) -> float | None:
    """The call's true CFG scale when it runs (``true_cfg_scale`` > 1 and a negative prompt, as
    diffusers' ``do_true_cfg``), else None: one branch. ``values`` may be checked or as given."""
    scale = values.get(TRUE_CFG_SCALE.name)
    if scale is None or values.get("negative_prompt") is None or float(scale) <= 1.0:
        return None
    return float(scale)
