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


@pytest.mark.parametrize("sampler", ["ddim", "euler", "heun", "dpmpp_2m", "lcm", "tcd", "unipc", "dpmpp_2m_sde",
                                     "pndm"])
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


@pytest.mark.parametrize("blend", [False, True], ids=["img2img", "inpaint"])
@pytest.mark.parametrize("sampler,extra", [("dpmpp_2m", {}), ("unipc", {}), ("unipc", {"solver_order": 3}),
                                           ("unipc", {"disable_corrector": [2]})],
                         ids=["dpmpp_2m", "unipc", "unipc-order3", "unipc-disable2"])
def test_multistep_start_matches_diffusers_img2img_loop(sampler, extra, blend):
    """``run(start=Start(...))`` of a multistep sampler is diffusers' img2img (and inpaint) loop on its
    scheduler: ``set_begin_index(t_start)``, ``add_noise`` at the first step kept, the history empty
    there (first order, no UniC), and the kept region re-noised to the next step after each step."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from preheat.samplers import Start, make_spec, run
    from tests._support.sampler_ref import fake_model_jax, fake_model_torch

    cfg, steps, strength = {**CONFIG, **extra}, 8, 0.7
    start = strength_start(steps, strength)
    rng = np.random.default_rng(3)
    x0, eps = (rng.standard_normal((1, 4, 8, 8), dtype=np.float32) for _ in range(2))
    keep = (np.arange(8)[None, None, :, None] < 4).astype(np.float32) * np.ones((1, 1, 8, 8), np.float32)

    scheduler = make_scheduler(sampler, cfg)
    scheduler.set_timesteps(steps)
    scheduler.set_begin_index(start)
    ts = scheduler.timesteps[start:]
    x0_t, eps_t, keep_t = (torch.from_numpy(a) for a in (x0, eps, keep))
    x = scheduler.add_noise(x0_t, eps_t, ts[:1])
    with torch.no_grad():
        for i, t in enumerate(ts):
            x = scheduler.step(fake_model_torch(x, t), t, x).prev_sample
            if blend:  # StableDiffusionInpaintPipeline's loop for a 4-channel UNet
                kept = x0_t if i == len(ts) - 1 else scheduler.add_noise(x0_t, eps_t, ts[i + 1:i + 2])
                x = (1 - keep_t) * kept + keep_t * x

    config = SchedulerConfig.from_dict(cfg)
    spec, plan = make_spec(config, sampler), make_plan(config, sampler, steps)
    begin = Start(index=jnp.int32(start), x0=jnp.asarray(x0), pure_noise=jnp.bool_(False),
                  keep=jnp.asarray(keep) if blend else None)
    ours = run(spec, fake_model_jax, plan, jnp.asarray(eps), lambda i, k: None, start=begin)
    np.testing.assert_allclose(np.asarray(ours), x.numpy(), rtol=1e-5, atol=2e-5)
    whole = run(spec, fake_model_jax, plan, jnp.asarray(eps), lambda i, k: None)
    assert not np.allclose(np.asarray(whole), x.numpy(), atol=1e-2)  # the start counts


@pytest.mark.parametrize("sampler", ["dpmpp_2m_sde", "dpmpp_2m_sde_karras", "pndm", "dpmpp_2m", "ddim"])
@pytest.mark.parametrize("steps,strength", [(6, 0.6), (9, 0.75), (5, 1.0)])
def test_a_run_from_start_matches_diffusers_img2img_loop(sampler, steps, strength, monkeypatch):
    """``run(start=Start(...))`` is diffusers' img2img loop on the bare scheduler: ``add_noise`` at
    ``timesteps[t_start]``, then ``step`` from there with a fresh scheduler state -- dpm++ first
    order without history, PNDM's counter from 0 (its call 1 redoes the first move from the start),
    the SDE's per-step noise drawn where ours is. Same fake model, inputs and noise table."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from preheat.samplers import Start, make_spec, run
    from tests._support import sampler_ref as R

    cfg = {**CONFIG, "prediction_type": "epsilon"}
    R.inject_torch_tables(monkeypatch)
    config = SchedulerConfig.from_dict(cfg)
    spec, plan = make_spec(config, sampler), make_plan(config, sampler, steps)
    start = strength_start(steps, strength)
    rng = np.random.default_rng(steps)
    x0, eps = (rng.standard_normal(R.SHAPE, dtype=np.float32) for _ in range(2))
    table = rng.standard_normal((plan.timesteps.shape[0], 1, *R.SHAPE), dtype=np.float32)

    sched = R.diffusers_scheduler(sampler, cfg)
    sched.set_timesteps(steps)
    timesteps = sched.timesteps[start * sched.order:]  # the pipeline's get_timesteps
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(start * sched.order)
    row = {"i": start}
    for mod in R.RANDN_MODULES:
        monkeypatch.setattr(mod, "randn_tensor", lambda shape, **_: torch.from_numpy(table[row["i"], 0].copy()))
    x = sched.add_noise(torch.from_numpy(x0), torch.from_numpy(eps), timesteps[:1])
    with torch.no_grad():
        for k, t in enumerate(timesteps):
            row["i"] = start + k
            x = sched.step(R.fake_model_torch(sched.scale_model_input(x, t), t), t, x).prev_sample
    ours = run(spec, R.fake_model_jax, plan, jnp.asarray(eps), lambda i, k: jnp.asarray(table)[i, k],
               start=Start(index=jnp.int32(start), x0=jnp.asarray(x0), pure_noise=jnp.bool_(False)))
    assert len(timesteps) == int(plan.n_steps) - start
    np.testing.assert_allclose(np.asarray(ours), x.numpy(), rtol=1e-5, atol=1e-5)
