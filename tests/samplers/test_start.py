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
# Playground v2.5's scheduler settings (EDM samplers take no betas)
EDM_CONFIG = {"_class_name": "EDMDPMSolverMultistepScheduler", "sigma_min": 0.002, "sigma_max": 80.0,
              "sigma_data": 0.5, "sigma_schedule": "karras"}


def _config(sampler: str) -> dict:
    return EDM_CONFIG if sampler.startswith("edm_") else CONFIG


@pytest.mark.parametrize("sampler", ["ddim", "euler", "heun", "dpmpp_2m", "lcm", "tcd", "unipc", "dpmpp_2m_sde",
                                     "pndm", "deis", "lms", "dpm2", "dpm2_a", "dpmpp_sde", "dpmpp_2s",
                                     "edm_euler", "edm_dpmpp_2m"])
@pytest.mark.parametrize("steps,strength", [(5, 0.6), (10, 0.75), (7, 0.3), (4, 1.0), (30, 0.9999)])
def test_sd_start_is_diffusers_get_timesteps(sampler, steps, strength):
    from diffusers import StableDiffusionImg2ImgPipeline

    scheduler = make_scheduler(sampler, _config(sampler))
    scheduler.set_timesteps(steps)
    theirs, remaining = StableDiffusionImg2ImgPipeline.get_timesteps(SimpleNamespace(scheduler=scheduler), steps,
                                                                     strength, "cpu")
    start = strength_start(steps, strength)
    plan = make_plan(SchedulerConfig.from_dict(_config(sampler)), sampler, steps)
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


# (sampler, scheduler config beyond CONFIG): multistep history (dpm++, unipc's orders and its
# corrector switch, deis's orders, lms's derivatives), per-step noise (the SDEs), PLMS's counter (pndm), and a one-step sampler.
START_SAMPLERS = [("dpmpp_2m", {}), ("unipc", {}), ("unipc", {"solver_order": 3}),
                  ("unipc", {"disable_corrector": [2]}), ("dpmpp_2m_sde", {}), ("dpmpp_2m_sde_karras", {}),
                  ("pndm", {}), ("ddim", {}), ("deis", {"solver_order": 3}), ("lms", {}), ("edm_euler", {}),
                  ("edm_dpmpp_2m", {}), ("edm_dpmpp_2m_sde", {"solver_type": "heun"}), ("dpmpp_2s", {}),
                  ("dpmpp_2s_karras", {})]
START_IDS = ["dpmpp_2m", "unipc", "unipc-order3", "unipc-disable2", "dpmpp_2m_sde", "dpmpp_2m_sde_karras", "pndm",
             "ddim", "deis-order3", "lms", "edm_euler", "edm_dpmpp_2m", "edm_dpmpp_2m_sde-heun", "dpmpp_2s",
             "dpmpp_2s_karras"]


@pytest.mark.parametrize("steps,strength,blend", [(6, 0.6, False), (9, 0.75, True), (8, 0.7, True),
                                                  (5, 1.0, False)],
                         ids=["img2img-6", "inpaint-9", "inpaint-8", "img2img-from-0"])
@pytest.mark.parametrize("sampler,extra", START_SAMPLERS, ids=START_IDS)
def test_a_run_from_start_matches_diffusers_img2img_loop(sampler, extra, steps, strength, blend, monkeypatch):
    """``denoise_loop(start=Start(...))`` is diffusers' img2img (and 4-channel inpaint) loop on the bare
    scheduler: ``add_noise`` at ``timesteps[t_start]``, then ``step`` from there with a fresh
    scheduler state -- a multistep sampler first order without history (no UniC there), PNDM's
    counter from 0 (its call 1 redoes the first move from the start), the SDE's per-step noise
    drawn where ours is -- and, inpainting, the kept region re-noised to the next step after each
    step. Same fake model, inputs and noise table."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from preheat.samplers import Start, make_spec, denoise_loop
    from tests._support import sampler_ref as R

    cfg = {**_config(sampler), "prediction_type": "epsilon", **extra}
    R.inject_torch_tables(monkeypatch)
    config = SchedulerConfig.from_dict(cfg)
    spec, plan = make_spec(config, sampler), make_plan(config, sampler, steps)
    start = strength_start(steps, strength)
    rng = np.random.default_rng(steps)
    x0, eps = (rng.standard_normal(R.SHAPE, dtype=np.float32) for _ in range(2))
    table = rng.standard_normal((plan.timesteps.shape[0], 1, *R.SHAPE), dtype=np.float32)
    keep = np.broadcast_to(np.arange(R.SHAPE[-2])[:, None] < R.SHAPE[-2] // 2, R.SHAPE).astype(np.float32)

    sched = R.diffusers_scheduler(sampler, cfg)
    sched.set_timesteps(steps)
    timesteps = sched.timesteps[start * sched.order:]  # the pipeline's get_timesteps
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(start * sched.order)
    row = {"i": start}
    for mod in R.RANDN_MODULES:
        monkeypatch.setattr(mod, "randn_tensor", lambda shape, **_: torch.from_numpy(table[row["i"], 0].copy()))
    x0_t, eps_t, keep_t = (torch.from_numpy(np.ascontiguousarray(a)) for a in (x0, eps, keep))
    x = sched.add_noise(x0_t, eps_t, timesteps[:1])
    with torch.no_grad():
        for k, t in enumerate(timesteps):
            row["i"] = start + k
            x = sched.step(R.fake_model_torch(sched.scale_model_input(x, t), t), t, x).prev_sample
            if blend:  # StableDiffusionInpaintPipeline's loop for a 4-channel UNet
                kept = x0_t if k == len(timesteps) - 1 else sched.add_noise(x0_t, eps_t, timesteps[k + 1:k + 2])
                x = (1 - keep_t) * kept + keep_t * x
    begin = Start(index=jnp.int32(start), x0=jnp.asarray(x0), pure_noise=jnp.bool_(False),
                  keep=jnp.asarray(keep) if blend else None)
    noise = lambda i, k: jnp.asarray(table)[i, k]  # noqa: E731
    ours = denoise_loop(spec, R.fake_model_jax, plan, jnp.asarray(eps), noise, start=begin)
    assert len(timesteps) == int(plan.n_steps) - start
    np.testing.assert_allclose(np.asarray(ours), x.numpy(), rtol=1e-5, atol=2e-5)
    if start:  # the start counts: the whole run from pure noise lands elsewhere
        whole = denoise_loop(spec, R.fake_model_jax, plan, jnp.asarray(eps), noise)
        assert not np.allclose(np.asarray(whole), x.numpy(), atol=1e-2)


@pytest.mark.parametrize("steps,fraction", [(7, 0.3), pytest.param(10, 0.8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sampler,extra", START_SAMPLERS, ids=START_IDS)
def test_a_restart_matches_two_diffusers_pipelines(sampler, extra, steps, fraction, monkeypatch):
    """``denoise_loop(restart=k)`` is SDXL's ensemble of experts on the bare schedulers: the first pipeline
    (``denoising_end``) steps its scheduler through the timesteps at or above the cutoff, and the
    second (``denoising_start``) a fresh scheduler of the same config through the rest, from the
    first's latents as they are (no noise added) -- its multistep history empty, PNDM's counter
    from 0, its order warming up again. Same fake model and noise table."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    from preheat.samplers import handoff_step, make_spec, denoise_loop
    from tests._support import sampler_ref as R

    cfg = {**_config(sampler), "prediction_type": "epsilon", **extra}
    R.inject_torch_tables(monkeypatch)
    config = SchedulerConfig.from_dict(cfg)
    spec, plan = make_spec(config, sampler), make_plan(config, sampler, steps)
    rng = np.random.default_rng(steps)
    eps = rng.standard_normal(R.SHAPE, dtype=np.float32)
    table = rng.standard_normal((plan.timesteps.shape[0], 1, *R.SHAPE), dtype=np.float32)
    row = {"i": 0}
    for mod in R.RANDN_MODULES:
        monkeypatch.setattr(mod, "randn_tensor", lambda shape, **_: torch.from_numpy(table[row["i"], 0].copy()))

    first = R.diffusers_scheduler(sampler, cfg)
    first.set_timesteps(steps)
    cutoff = int(round(first.config.num_train_timesteps * (1 - fraction)))  # the pipelines' discrete cutoff
    base_steps = [t for t in first.timesteps if t >= cutoff]  # StableDiffusionXLPipeline(denoising_end=fraction)
    x = torch.from_numpy(eps) * first.init_noise_sigma
    with torch.no_grad():
        for k, t in enumerate(base_steps):
            row["i"] = k
            x = first.step(R.fake_model_torch(first.scale_model_input(x, t), t), t, x).prev_sample
        second = R.diffusers_scheduler(sampler, cfg)  # StableDiffusionXLImg2ImgPipeline(denoising_start=fraction)
        second.set_timesteps(steps)
        rest = int((second.timesteps < cutoff).sum())
        begin = len(second.timesteps) - rest
        if hasattr(second, "set_begin_index"):
            second.set_begin_index(begin)
        for k, t in enumerate(second.timesteps[begin:]):
            row["i"] = begin + k
            x = second.step(R.fake_model_torch(second.scale_model_input(x, t), t), t, x).prev_sample
    handoff = handoff_step(plan, 1000, fraction)
    assert handoff == len(base_steps) == begin
    noise = lambda i, k: jnp.asarray(table)[i, k]  # noqa: E731
    ours = denoise_loop(spec, R.fake_model_jax, plan, jnp.asarray(eps), noise, restart=jnp.int32(handoff))
    np.testing.assert_allclose(np.asarray(ours), x.numpy(), rtol=1e-5, atol=2e-5)
    if not sampler.startswith("edm_"):  # (EDM's timesteps are c_noise, all below the cutoff: the first runs none)
        assert 0 < handoff < steps
    if 0 < handoff < steps and spec.solver in ("dpmpp_2m", "unipc", "deis", "lms", "pndm"):
        # the restart counts: a multistep solver's history carried on lands elsewhere
        whole = denoise_loop(spec, R.fake_model_jax, plan, jnp.asarray(eps), noise)
        assert not np.allclose(np.asarray(whole), x.numpy(), atol=1e-4)
