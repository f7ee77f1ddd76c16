"""Guidance rescale: diffusers' ``guidance_rescale`` ("Common Diffusion Noise Schedules and Sample
Steps are Flawed", section 3.4), declared once for the families whose diffusers pipelines take it
(SD 1.x / 2.x and SDXL: text-to-image, img2img and inpainting run through the same families).

    input              value                          reaches
    -----------------  -----------------------------  ---------------------------------------------
    guidance_rescale   phi in [0, 1] (0: off, as      DenoiseArgs.guidance_rescale, () float32:
                       diffusers' default)            ``engine.rescaled_guidance`` after the CFG
                                                      combination, before the sampler's step

It reshapes classifier-free guidance's combination, so it is ``needs_guidance``: a call that runs
unguided refuses any value but the default 0. It is data: one program serves every value (0 selects
the plain combination exactly). A family that does not declare it, and every unguided call, gets
the program without it (``DenoiseArgs.guidance_rescale`` None).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from preheat.families.inputs import Float, InputSpec

if TYPE_CHECKING:
    from preheat.families.base import Request

__all__ = ["GUIDANCE_RESCALE", "guidance_rescale"]

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
