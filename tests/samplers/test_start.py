"""``strength_start``: the first step an img2img call runs is diffusers' ``get_timesteps(strength)``
for every sampler -- Heun's interleaved (order 2) schedule and flow pipelines' rule included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from preheat.errors import SchedulerConfigError
from preheat.samplers import SchedulerConfig, make_plan, strength_start
from preheat.backends.torch.sampling import make_scheduler

CONFIG = {"num_train_timesteps": 1000, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
          "steps_offset": 1, "timestep_spacing": "leading"}


@pytest.mark.parametrize("sampler", ["ddim", "euler", "heun", "dpmpp_2m", "lcm", "tcd"])
@pytest.mark.parametrize("steps,strength", [(5, 0.6), (10, 0.75), (7, 0.3), (4, 1.0), (30, 0.9999)])
def test_sd_start_is_diffusers_get_timesteps(sampler, steps, strength):
    from diffusers import StableDiffusionImg2ImgPipeline

    scheduler = make_scheduler(sampler, CONFIG)
    scheduler.set_timesteps(steps)
    theirs, remaining = StableDiffusionImg2ImgPipeline.get_timesteps(SimpleNamespace(scheduler=scheduler), steps,
                                                                     strength, "cpu")
    start = strength_start(steps, strength)
    plan = make_plan(SchedulerConfig.from_dict(CONFIG), sampler, steps)
    assert remaining == steps - start
    assert float(theirs[0]) == pytest.approx(float(plan.timesteps[start]), abs=1e-3)
    if hasattr(scheduler, "set_begin_index"):  # sigma schedulers: the index add_noise reads
        assert scheduler.begin_index == start * scheduler.order


@pytest.mark.parametrize("steps,strength", [(5, 0.6), (10, 0.75), (28, 0.95), (4, 0.1)])
def test_flow_start_is_flux_get_timesteps(steps, strength):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxImg2ImgPipeline

    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(steps)
    _, remaining = FluxImg2ImgPipeline.get_timesteps(SimpleNamespace(scheduler=scheduler), steps, strength, "cpu")
    assert remaining == steps - strength_start(steps, strength, "flow")


def test_a_start_with_no_step_left_is_refused():
    with pytest.raises(SchedulerConfigError) as info:
        strength_start(5, 0.1)  # int(0.5) = 0 steps
    assert info.value.argument == "strength" and "runs no step" in str(info.value)
    assert strength_start(5, 0.1, "flow") == 4  # int(5 - 0.5): one step
