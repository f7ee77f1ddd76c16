"""The schedule inputs a diffusion family declares (SD, SDXL, pixel UNets): what a model card
changes of the scheduler for a call, written once so every family that samples a discrete
diffusion schedule takes them with the same names, flags and fields.

    timestep_spacing   Scheduler.from_config(config, timestep_spacing=...)   a scheduler_key input
    timesteps          scheduler.set_timesteps(timesteps=[...])              a plan_key input; its
                                                                             count is the steps

Both are data (the schedule is a padded ``Plan``), so neither selects another program. Flow
families (SD3, FLUX) take neither: their pipelines pass sigmas and mu instead.
"""

from __future__ import annotations

from preheat.families.inputs import Choice, InputSpec, Ints
from preheat.samplers import TIMESTEP_SPACINGS

__all__ = ["TIMESTEP_SPACING", "TIMESTEPS", "SCHEDULE_SPECS"]

# A model card's ``Scheduler.from_config(pipe.scheduler.config, timestep_spacing="trailing")`` (SDXL-Lightning,
# Hyper-SD): the schedule is data, so a call may set it (None: the folder's config says)
TIMESTEP_SPACING = InputSpec("timestep_spacing", Choice(TIMESTEP_SPACINGS), "The sampler's timestep spacing, as "
                             "from_config(..., timestep_spacing=...) sets it (the folder's scheduler config when "
                             "absent).", scheduler_key=True)
# Hyper-SD's 1-step cards: ``pipe(..., timesteps=[800])`` (set_timesteps' own list; lcm and tcd take it)
TIMESTEPS = InputSpec("timesteps", Ints(0), "Custom timesteps, strictly decreasing, as set_timesteps(timesteps=...) "
                      "takes them (samplers lcm, tcd); their count is the steps.", plan_key=True, counts_steps=True)
SCHEDULE_SPECS: tuple[InputSpec, ...] = (TIMESTEP_SPACING, TIMESTEPS)
