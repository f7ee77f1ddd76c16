"""The runtime contract every sampler meets: one jitted program for any step count, the
fori_loop driver equal to stepping by hand, explicit noise, data-space output."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preheat.samplers import DIFFUSION_SAMPLERS, Plan, SchedulerConfig, SolverSpec, init, make_plan, make_spec, denoise_loop, step
from preheat.samplers import _schedules
from tests._support.sampler_ref import SHAPE, fake_model_jax, noise_for, run_ours

CFG = SchedulerConfig.from_dict({"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012})
ROWS = 1001  # plan length for num_train_timesteps = 1000


def make_run_jit():
    """What the engine does: the whole loop as one program, plan and noise traced. A fresh
    jitted function each time, with its own trace counter."""
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def run_jit(spec: SolverSpec, plan: Plan, noise: jax.Array, table: jax.Array) -> jax.Array:
        traces.append(spec)  # Python side effect: runs once per trace, never when cached
        return denoise_loop(spec, fake_model_jax, plan, noise, lambda i, k: table[i, k])

    return run_jit, traces


def _eta(sampler: str) -> float:
    return 0.5 if sampler in ("ddim", "tcd") else 0.0


@pytest.mark.parametrize("sampler", DIFFUSION_SAMPLERS)
def test_run_matches_step_by_step(sampler: str) -> None:
    spec, plan = make_spec(CFG, sampler), make_plan(CFG, sampler, 12, eta=_eta(sampler))
    x_t, table = noise_for(3, ROWS)
    run_jit, _ = make_run_jit()
    final = np.asarray(run_jit(spec, plan, x_t, table))
    _, jit_steps = run_ours(spec, plan, x_t, table, jit=True)
    _, eager_steps = run_ours(spec, plan, x_t, table, jit=False)
    assert final.shape == SHAPE and final.dtype == np.float32 and np.all(np.isfinite(final))
    np.testing.assert_allclose(final, jit_steps[-1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(eager_steps[-1], jit_steps[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampler", DIFFUSION_SAMPLERS)
def test_changing_steps_does_not_retrace(sampler: str) -> None:
    spec = make_spec(CFG, sampler)
    x_t, table = noise_for(4, ROWS)
    variants = [make_plan(CFG, sampler, n, eta=_eta(sampler)) for n in (3, 12, 25)]
    if sampler == "ddim":
        variants.append(make_plan(CFG, sampler, 12, eta=0.0))  # eta is data too
    if sampler.startswith(("dpmpp_2m", "dpmpp_2s")):  # Karras or not is schedule data: same program
        other = sampler[: -len("_karras")] if sampler.endswith("_karras") else sampler + "_karras"
        assert make_spec(CFG, other) == spec
        variants.append(make_plan(CFG, other, 12))
    run_jit, traces = make_run_jit()
    outs = [np.asarray(run_jit(spec, plan, x_t, table)) for plan in variants]
    assert len(traces) == 1
    assert run_jit._cache_size() == 1
    assert not np.allclose(outs[0], outs[1])  # ... and the step count did take effect


@pytest.mark.parametrize("sampler", DIFFUSION_SAMPLERS)
def test_model_calls_and_noise_draws(sampler: str) -> None:
    """Heun calls the model twice per step except onto sigma = 0; noise is drawn only through
    noise_fn, as many times as the spec says."""
    spec, plan = make_spec(CFG, sampler), make_plan(CFG, sampler, 5, eta=_eta(sampler))
    counts = {"model": 0, "noise": 0}

    def bump(name: str) -> None:
        counts[name] += 1

    def model(x: jax.Array, t: jax.Array) -> jax.Array:
        jax.debug.callback(functools.partial(bump, "model"))
        return fake_model_jax(x, t)

    def noise_fn(i: jax.Array, k: int) -> jax.Array:
        assert k < spec.noise_draws_per_step
        jax.debug.callback(functools.partial(bump, "noise"))
        return jax.random.normal(jax.random.fold_in(jax.random.key(0), i), SHAPE)

    x = jax.jit(lambda p, n: denoise_loop(spec, model, p, n, noise_fn))(plan, jnp.ones(SHAPE))
    jax.block_until_ready(x)
    jax.effects_barrier()
    n = int(plan.n_steps)
    two_calls = sampler in ("heun", "dpm2", "dpm2_a", "dpmpp_sde")
    assert counts["model"] == (2 * n - 1 if two_calls else n)
    assert spec.max_model_calls_per_step == (2 if two_calls else 1)
    # dpmpp_sde's last step (onto sigma 0) is Euler's: it draws nothing there
    assert counts["noise"] == (n - 1 if sampler == "dpmpp_sde" else n) * spec.noise_draws_per_step
    one = ("ddpm", "ddim", "euler_a", "lcm", "tcd", "dpmpp_2m_sde", "dpmpp_2m_sde_karras", "dpm2_a")
    assert spec.noise_draws_per_step == (1 if sampler in one else 2 if sampler == "dpmpp_sde" else 0)


@pytest.mark.parametrize("sampler", DIFFUSION_SAMPLERS)
def test_init_scales_noise_and_sets_history(sampler: str) -> None:
    """Each solver starts a state of its own type: the scaled noise, and what a multistep solver
    remembers, empty (the one-step solvers remember nothing)."""
    for cfg in (CFG, SchedulerConfig(timestep_spacing="leading")):
        spec, plan = make_spec(cfg, sampler), make_plan(cfg, sampler, 10)
        noise = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
        state = init(spec, plan, noise)
        np.testing.assert_array_equal(np.asarray(state.x), noise * plan.init_noise_sigma)
        if sampler.startswith("dpmpp_2m"):  # the previous x0, zeros
            assert state._fields == ("x", "x0_prev") and not np.any(np.asarray(state.x0_prev))
        elif sampler.startswith("dpmpp_2s"):  # ... and the first singlestep pair starts at the first sample
            assert state._fields == ("x", "x0_prev", "x_pair") and not np.any(np.asarray(state.x0_prev))
            np.testing.assert_array_equal(np.asarray(state.x_pair), np.asarray(state.x))
        elif sampler == "unipc":  # solver_order (2) x0 predictions, and the sample UniC starts from
            assert state._fields == ("x", "x0_history", "x_last")
            assert state.x0_history.shape == (2, *SHAPE) and not np.any(np.asarray(state.x0_history))
            np.testing.assert_array_equal(np.asarray(state.x_last), np.asarray(state.x))
        elif sampler == "pndm":  # diffusers' counter, cur_sample and ets, explicit
            assert state._fields == ("x", "count", "x_start", "outputs")
            assert int(state.count) == 0 and state.outputs.shape == (3, *SHAPE) and state.x_start.shape == SHAPE
        elif sampler == "deis":  # solver_order (2) noise predictions
            assert state._fields == ("x", "eps_history")
            assert state.eps_history.shape == (2, *SHAPE) and not np.any(np.asarray(state.eps_history))
        elif sampler == "lms":  # the three earlier derivatives its order-4 step weighs
            assert state._fields == ("x", "derivatives")
            assert state.derivatives.shape == (3, *SHAPE) and not np.any(np.asarray(state.derivatives))
        else:
            assert state._fields == ("x",)
        stepped = step(spec, fake_model_jax, plan, state, 0, lambda i, k: jnp.zeros(SHAPE))
        assert type(stepped) is type(state)  # a step keeps its solver's state type (the fori_loop carry)
        expect_one = sampler in ("ddpm", "ddim", "lcm", "tcd", "unipc", "pndm", "deis", "dpmpp_2m", "dpmpp_2m_karras",
                                 "dpmpp_2m_sde", "dpmpp_2m_sde_karras", "dpmpp_2s", "dpmpp_2s_karras")
        assert (plan.init_noise_sigma == 1.0) == expect_one


@pytest.mark.parametrize("sampler", DIFFUSION_SAMPLERS)
def test_final_sample_is_in_data_space(sampler: str) -> None:
    """With a model that always predicts the same clean image, every sampler must end on it
    (tcd and deis: at timestep 0's noise level, ``sqrt(ab_0) x0 + sqrt(1 - ab_0) eps``, as TCDScheduler
    and DEISMultistepScheduler end)."""
    cfg = SchedulerConfig.from_dict({
        "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
        "prediction_type": "sample", "clip_sample": False,
    })
    target = jnp.asarray(np.linspace(-0.9, 0.9, np.prod(SHAPE), dtype=np.float32).reshape(SHAPE))

    def model(x: jax.Array, t: jax.Array) -> jax.Array:
        return jnp.broadcast_to(target, x.shape)

    if sampler in ("pndm", "dpm2", "dpm2_a", "dpmpp_sde"):  # their classes take no "sample": that image's epsilon
        # (pndm ending at alpha 1)
        cfg = SchedulerConfig.from_dict({**{k: getattr(cfg, k) for k in ("beta_schedule", "beta_start", "beta_end")},
                                         "set_alpha_to_one": True})
        ab = jnp.asarray(_schedules.alphas_cumprod(_schedules.betas("scaled_linear", 0.00085, 0.012, 1000)))

        def model(x: jax.Array, t: jax.Array) -> jax.Array:  # noqa: F811
            a = ab[t.astype(jnp.int32)]
            return (x - jnp.sqrt(a) * target) / jnp.sqrt(1.0 - a)

        if sampler != "pndm":  # variance exploding, at fractional t: the sigma of t, as its schedule interpolates
            train_sigmas = jnp.sqrt((1.0 - ab) / ab)

            def model(z: jax.Array, t: jax.Array) -> jax.Array:  # noqa: F811
                sigma = jnp.interp(t, jnp.arange(1000), train_sigmas)
                return (z * jnp.sqrt(sigma * sigma + 1.0) - target) / sigma

    spec, plan = make_spec(cfg, sampler), make_plan(cfg, sampler, 8, eta=_eta(sampler))
    noise = np.random.default_rng(1).standard_normal(SHAPE, dtype=np.float32)
    x = denoise_loop(spec, model, plan, noise, lambda i, k: jax.random.normal(jax.random.fold_in(jax.random.key(1), i), SHAPE))
    if sampler in ("tcd", "deis"):
        if sampler == "tcd":
            ab0 = np.float32(plan.alpha_bar_mid[int(plan.n_steps) - 1])  # the last step's s is 0
        else:  # the last sigma is timestep 0's: alpha^2 = 1 / (1 + sigma^2) = alphas_cumprod[0]
            ab0 = np.float32(1.0 / (1.0 + np.float64(plan.sigmas[int(plan.n_steps)]) ** 2))
        np.testing.assert_allclose(ab0, np.float32(1 - 0.00085), rtol=1e-6)  # alphas_cumprod[0] = 1 - beta_0
        eps = (np.asarray(x) - np.sqrt(ab0) * np.asarray(target)) / np.sqrt(1 - ab0)
        assert np.abs(eps).max() < 6  # a noise draw's size: x is the target at t = 0's level
        assert np.abs(np.asarray(x) - np.asarray(target)).mean() < 0.05
        return
    np.testing.assert_allclose(np.asarray(x), np.asarray(target), atol=1e-4)


def test_step_is_pure() -> None:
    """Same inputs, same output: no hidden state survives a call (the diffusers _step_index bug)."""
    spec, plan = make_spec(CFG, "dpmpp_2m"), make_plan(CFG, "dpmpp_2m", 10)
    state = init(spec, plan, np.ones(SHAPE, np.float32))
    zero = lambda i, k: jnp.zeros(SHAPE)  # noqa: E731
    s1 = step(spec, fake_model_jax, plan, state, 0, zero)
    step(spec, fake_model_jax, plan, s1, 1, zero)
    again = step(spec, fake_model_jax, plan, state, 0, zero)
    np.testing.assert_array_equal(np.asarray(again.x), np.asarray(s1.x))


def test_every_sampler_runs_a_solver_of_the_loop() -> None:
    """Every sampler's solver is in the loop's table (no other), and mask blending is offered exactly
    where a step is one scheduler call (Heun's and the midpoint solvers' two calls are one step here)."""
    from preheat.samplers import BLEND_SOLVERS, SAMPLERS
    from preheat.samplers._loop import SOLVERS

    assert {make_spec(SchedulerConfig(), sampler).solver for sampler in SAMPLERS} == set(SOLVERS)
    assert set(SOLVERS) - set(BLEND_SOLVERS) == {"heun", "dpm2", "dpm2_a", "dpmpp_sde"}
