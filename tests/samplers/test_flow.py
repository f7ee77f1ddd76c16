"""Flow-matching samplers (flow_euler, flow_heun) against diffusers' FlowMatchEulerDiscreteScheduler
and FlowMatchHeunDiscreteScheduler.

What "exact" means here (see also test_sampler_parity):

* Schedules are compared *bitwise*. diffusers builds them from IEEE float32 torch arithmetic
  (``linspace(1, T, T) / T``, the shift, ``sigmas * T``, ``1 - sigmas``), float64/float32 numpy
  and Python ``math``; make_plan performs the same operations on the same dtypes, so equality is
  a property on any CPU (numpy's ``exp``/``power`` run on both sides).
* Samples after every step: float32 jax vs float32 torch on the same toy model. XLA fuses and
  reorders, so they cannot be bitwise equal. Both are also compared with the same steps done in
  float64 (``float64_steps``, the schedule being the bitwise-checked one): ours must be within
  ``rtol = atol = 1e-5`` of it, and within ``1e-5 + 2 * err_i`` of diffusers, ``err_i`` being
  diffusers' own float32 error at step i. That error is ~1e-7 for Euler, but FlowMatchHeun
  rebuilds the velocity as ``(x - (x - v * sigma)) / sigma``, which at a small sigma loses
  digits (~5e-5 at sigma = 0.001); ours uses ``v`` itself.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import diffusers
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_calculate_shift
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift as sd3_calculate_shift
from preheat.errors import SchedulerConfigError
from preheat.samplers import (DIFFUSION_SAMPLERS, EDM_SAMPLERS, FLOW_SAMPLERS, MU_SIGMAS_SAMPLERS, SAMPLERS, Plan, SchedulerConfig,
                              SolverSpec, config_kind, flow_mu, flux_sigmas, make_plan, make_spec, denoise_loop)
from preheat.samplers._tables import CLASS_DEFAULTS, DIFFUSERS_CLASS
from tests._support.sampler_ref import SHAPE, fake_model_jax, fake_model_torch, max_errors, run_ours

EULER = "FlowMatchEulerDiscreteScheduler"
HEUN = "FlowMatchHeunDiscreteScheduler"
CLASSES = {"flow_euler": diffusers.FlowMatchEulerDiscreteScheduler, "flow_heun": diffusers.FlowMatchHeunDiscreteScheduler}
ROWS = 1001

# Published configs (values as in their scheduler_config.json), tiny edits named in the id.
SCHNELL = {"_class_name": EULER, "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}
DEV = {"_class_name": EULER, "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
       "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}
SD3 = {"_class_name": EULER, "num_train_timesteps": 1000, "shift": 3.0}


def _mu(cfg: dict[str, Any], seq_len: int = 1024) -> float:
    return flow_mu(SchedulerConfig.from_dict(cfg), seq_len)


# (id, sampler, config, mu, flux sigmas?) -- each crossed with several step counts
SCHEDULES: list[tuple[str, str, dict[str, Any], float | None, bool]] = [
    ("schnell-flux", "flow_euler", SCHNELL, _mu(SCHNELL), True),  # what FluxPipeline does (mu ignored)
    ("schnell-default", "flow_euler", SCHNELL, None, False),
    ("dev-flux", "flow_euler", DEV, _mu(DEV), True),
    ("dev-flux-4096", "flow_euler", DEV, _mu(DEV, 4096), True),
    ("dev-default-sigmas", "flow_euler", DEV, 0.73, False),
    ("dev-linear", "flow_euler", {**DEV, "time_shift_type": "linear"}, 1.7, True),
    ("dev-linear-default", "flow_euler", {**DEV, "time_shift_type": "linear"}, 0.4, False),
    ("sd3", "flow_euler", SD3, None, False),  # what StableDiffusion3Pipeline does
    ("sd3-shift1.15", "flow_euler", {**SD3, "shift": 1.15}, None, False),  # shift not exact in float32
    ("sd3-flux-sigmas", "flow_euler", SD3, None, True),
    ("invert", "flow_euler", {**SD3, "invert_sigmas": True}, None, False),
    ("invert-flux", "flow_euler", {**SCHNELL, "invert_sigmas": True}, None, True),
    ("terminal", "flow_euler", {**SD3, "shift_terminal": 0.1}, None, False),
    ("terminal-dev", "flow_euler", {**DEV, "shift_terminal": 0.05}, 1.1, True),
    ("karras", "flow_euler", {**SD3, "use_karras_sigmas": True}, None, False),
    ("karras-dev", "flow_euler", {**DEV, "use_karras_sigmas": True}, 0.9, True),
    ("exponential", "flow_euler", {**SD3, "use_exponential_sigmas": True}, None, True),
    ("karras-sigma-range", "flow_euler", {**SD3, "use_karras_sigmas": True, "sigma_min": 0.01, "sigma_max": 0.9},
     None, False),
    ("T100", "flow_euler", {"_class_name": EULER, "num_train_timesteps": 100, "shift": 2.0}, None, False),
    ("heun-shift1", "flow_heun", {"_class_name": HEUN, "shift": 1.0}, None, False),
    ("heun-shift3", "flow_heun", {"_class_name": HEUN, "shift": 3.0}, None, False),
    # diffusers' from_config drops what FlowMatchHeun does not read: dynamic shifting too
    ("heun-dev-config", "flow_heun", DEV, None, False),
]
STEPS = (1, 2, 4, 13, 28)


def _no_single_step(case_id: str, steps: int) -> bool:
    # shift_terminal stretches by (1 - last sigma): with one step the last sigma is 1 (0/0)
    return "terminal" in case_id and steps == 1


def diffusers_schedule(sampler: str, cfg: dict[str, Any], steps: int, mu: float | None,
                       flux: bool) -> tuple[Any, np.ndarray, np.ndarray]:
    """The scheduler as a pipeline sets it up, and (timesteps, sigmas) of *our* steps."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = CLASSES[sampler].from_config(dict(cfg))
    kwargs: dict[str, Any] = {}
    if mu is not None:
        kwargs["mu"] = mu
    if flux:
        kwargs["sigmas"] = np.linspace(1.0, 1 / steps, steps)  # FluxPipeline's line, restated
    sched.set_timesteps(steps, **kwargs)
    ts, sig = sched.timesteps.numpy(), sched.sigmas.numpy()
    if sampler == "flow_heun":  # [t0, t1, t1, t2, t2, ...]: one entry per model call
        ts, sig = np.concatenate([ts[:1], ts[1::2]]), np.concatenate([sig[:1], sig[1::2]])
    return sched, ts, sig


def ours(sampler: str, cfg: dict[str, Any], steps: int, mu: float | None, flux: bool) -> tuple[SolverSpec, Plan]:
    config = SchedulerConfig.from_dict(cfg)
    kwargs: dict[str, Any] = {"mu": mu} if mu is not None else {}
    if flux:
        kwargs["sigmas"] = flux_sigmas(steps)
    return make_spec(config, sampler), make_plan(config, sampler, steps, **kwargs)


def _cases() -> list[Any]:
    return [pytest.param(s, c, m, f, n, id=f"{i}-{n}")
            for i, s, c, m, f in SCHEDULES for n in STEPS if not _no_single_step(i, n)]


# --- schedules -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler,cfg,mu,flux,steps", _cases())
def test_schedule_matches_diffusers(sampler: str, cfg: dict[str, Any], mu: float | None, flux: bool,
                                    steps: int) -> None:
    _, ts, sig = diffusers_schedule(sampler, cfg, steps, mu, flux)
    spec, plan = ours(sampler, cfg, steps, mu, flux)
    n = int(plan.n_steps)
    assert n == steps == len(ts)
    np.testing.assert_array_equal(plan.timesteps[:n], ts)
    np.testing.assert_array_equal(plan.sigmas[: n + 1], sig)
    assert float(plan.init_noise_sigma) == 1.0  # the pipelines start from unscaled noise
    assert spec.prediction_type == "flow" and spec.solver == {"flow_euler": "euler", "flow_heun": "heun"}[sampler]
    assert plan.timesteps.shape == plan.sigmas.shape == (cfg.get("num_train_timesteps", 1000) + 1,)
    assert np.all(plan.timesteps[n:] == 0) and np.all(plan.sigmas[n + 1:] == 0)


def test_flow_mu_is_the_pipelines_calculate_shift() -> None:
    """Flux and SD3 share calculate_shift; ours reads the config's values (class defaults if absent)."""
    cfgs = [DEV, {**DEV, "base_shift": 0.3, "max_shift": 1.6, "base_image_seq_len": 64, "max_image_seq_len": 1024},
            {"_class_name": EULER, "use_dynamic_shifting": True}]
    for cfg in cfgs:
        sched = diffusers.FlowMatchEulerDiscreteScheduler.from_config(dict(cfg))
        c = sched.config
        for seq_len in (16, 256, 1024, 4096, 6000):
            args = (seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
            assert _mu(cfg, seq_len) == flux_calculate_shift(*args) == sd3_calculate_shift(*args)
    assert _mu(DEV, 256) == 0.5 and abs(_mu(DEV, 4096) - 1.15) < 1e-12


def test_flux_sigmas() -> None:
    for steps in (1, 4, 28):
        s = flux_sigmas(steps)
        assert s.dtype == np.float64 and len(s) == steps and s[0] == 1.0 and s[-1] == 1 / steps
        assert np.all(np.diff(s) < 0)


def test_class_defaults_match_diffusers_signatures() -> None:
    for sampler in FLOW_SAMPLERS:
        params = inspect.signature(getattr(diffusers, DIFFUSERS_CLASS[sampler]).__init__).parameters
        for key, value in CLASS_DEFAULTS[sampler].items():
            if key in ("sigma_min", "sigma_max"):  # read through the config only (hasattr)
                assert key not in params and value is None
                continue
            assert params[key].default == value, f"{DIFFUSERS_CLASS[sampler]}.{key}"
        assert set(params) - {"self"} <= set(CLASS_DEFAULTS[sampler])  # every key of the class known
    set_timesteps = inspect.signature(diffusers.FlowMatchEulerDiscreteScheduler.set_timesteps).parameters
    assert {"mu", "sigmas"} <= set(set_timesteps)
    assert not {"mu", "sigmas"} & set(inspect.signature(diffusers.FlowMatchHeunDiscreteScheduler.set_timesteps).parameters)
    assert MU_SIGMAS_SAMPLERS == ("flow_euler",)


# --- solver steps ----------------------------------------------------------------------------------


def run_diffusers(sampler: str, cfg: dict[str, Any], steps: int, mu: float | None, flux: bool,
                  x_t: np.ndarray) -> list[np.ndarray]:
    """A pipeline's denoising loop with the toy model; the sample after each of *our* steps."""
    sched, _, _ = diffusers_schedule(sampler, cfg, steps, mu, flux)
    sched.set_begin_index(0)  # as the Flux and SD3 pipelines do
    x = torch.from_numpy(x_t.copy())  # init_noise_sigma is 1
    xs = []
    calls = len(sched.timesteps)
    with torch.no_grad():
        for call, t in enumerate(sched.timesteps):
            x = sched.step(fake_model_torch(x, t), t, x).prev_sample
            if sampler != "flow_heun" or call % 2 == 1 or call == calls - 1:
                xs.append(x.numpy().copy())
    return xs


def float64_steps(sampler: str, timesteps: np.ndarray, sigmas: np.ndarray, x_t: np.ndarray) -> list[np.ndarray]:
    """Euler / Heun in sigma on the velocity, in float64 (the toy model too), on a given schedule."""
    t64, s64 = timesteps.astype(np.float64), sigmas.astype(np.float64)

    def v(x: np.ndarray, t: float) -> np.ndarray:
        return fake_model_torch(torch.from_numpy(x), torch.tensor(t, dtype=torch.float64)).numpy()

    x, xs = x_t.astype(np.float64), []
    for i in range(len(sigmas) - 1):
        dt = s64[i + 1] - s64[i]
        d = v(x, t64[i])
        x_euler = x + dt * d
        if sampler == "flow_heun" and s64[i + 1] > 0:
            x = x + dt * (d + v(x_euler, t64[i + 1])) / 2
        else:
            x = x_euler
        xs.append(x)
    return xs


SOLVER_CASES = [c for c in SCHEDULES if c[0] in ("schnell-flux", "dev-flux", "sd3", "invert", "terminal", "karras",
                                                 "heun-shift1", "heun-shift3", "heun-dev-config")]


@pytest.mark.parametrize("sampler,cfg,mu,flux,steps", [
    pytest.param(s, c, m, f, n, id=f"{i}-{n}") for i, s, c, m, f in SOLVER_CASES for n in (1, 2, 3, 9, 28)
    if not _no_single_step(i, n)])
def test_steps_match_diffusers(sampler: str, cfg: dict[str, Any], mu: float | None, flux: bool, steps: int) -> None:
    spec, plan = ours(sampler, cfg, steps, mu, flux)
    x_t = np.random.default_rng(steps).standard_normal(SHAPE, dtype=np.float32)
    _, ts, sig = diffusers_schedule(sampler, cfg, steps, mu, flux)
    np.testing.assert_array_equal(plan.sigmas[: steps + 1], sig)
    theirs = run_diffusers(sampler, cfg, steps, mu, flux, x_t)
    exact = float64_steps(sampler, plan.timesteps[: steps + 1], plan.sigmas[: steps + 1], x_t)
    x_init, mine = run_ours(spec, plan, x_t, np.zeros((ROWS, 1, *SHAPE), np.float32))
    np.testing.assert_array_equal(x_init, x_t)
    assert len(mine) == len(theirs) == steps
    for i, (a, b, e) in enumerate(zip(mine, theirs, exact)):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=f"float64 math, step {i} of {steps}")
        err = float(np.max(np.abs(b - e)))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 + 2 * err,
                                   err_msg=f"step {i} of {steps} (diffusers' float32 error here: {err:.3g})")


def test_negative_control_heun_is_not_euler() -> None:
    """The parity check above tells the solvers apart (and a schedule one step off)."""
    cfg = {"shift": 3.0}
    x_t = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    heun = run_diffusers("flow_heun", cfg, 4, None, False, x_t)
    spec, plan = ours("flow_euler", cfg, 4, None, False)
    _, euler = run_ours(spec, plan, x_t, np.zeros((ROWS, 1, *SHAPE), np.float32))
    assert max_errors(euler, heun)[0] > 1e-3
    spec, plan = ours("flow_euler", cfg, 5, None, False)
    _, off = run_ours(spec, plan, x_t, np.zeros((ROWS, 1, *SHAPE), np.float32))
    assert max_errors(off[:4], run_diffusers("flow_euler", cfg, 4, None, False, x_t))[0] > 1e-3


# --- runtime contract ------------------------------------------------------------------------------


def make_run_jit():
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def run_jit(spec: SolverSpec, plan: Plan, noise: jax.Array) -> jax.Array:
        traces.append(spec)  # runs once per trace
        return denoise_loop(spec, fake_model_jax, plan, noise, lambda i, k: jnp.zeros_like(noise))

    return run_jit, traces


def test_steps_mu_sigmas_and_shift_are_data() -> None:
    """One compiled program per flow solver, whatever the step count, mu, custom sigmas or shift."""
    x_t = np.random.default_rng(1).standard_normal(SHAPE, dtype=np.float32)
    dev, sd3 = SchedulerConfig.from_dict(DEV), SchedulerConfig.from_dict(SD3)
    plans = [
        make_plan(dev, "flow_euler", 4, mu=0.5, sigmas=flux_sigmas(4)),
        make_plan(dev, "flow_euler", 28, mu=0.5, sigmas=flux_sigmas(28)),
        make_plan(dev, "flow_euler", 28, mu=1.15, sigmas=flux_sigmas(28)),
        make_plan(dev, "flow_euler", 28, mu=1.15),
        make_plan(sd3, "flow_euler", 28),
        make_plan(SchedulerConfig.from_dict({**SD3, "shift": 6.0}), "flow_euler", 28),
        make_plan(SchedulerConfig.from_dict(SCHNELL), "flow_euler", 1, sigmas=flux_sigmas(1)),
    ]
    spec = make_spec(dev, "flow_euler")
    assert all(make_spec(c, "flow_euler") == spec for c in (sd3, SchedulerConfig.from_dict(SCHNELL)))
    run_jit, traces = make_run_jit()
    outs = [np.asarray(run_jit(spec, p, x_t)) for p in plans]
    assert len(traces) == 1 and run_jit._cache_size() == 1
    for a, b in zip(outs, outs[1:]):
        assert not np.allclose(a, b)  # each change did take effect

    heun = SchedulerConfig.from_dict({"_class_name": HEUN, "shift": 3.0})
    spec = make_spec(heun, "flow_heun")
    outs = [np.asarray(run_jit(spec, make_plan(heun, "flow_heun", n), x_t)) for n in (1, 2, 12)]
    assert len(traces) == 2 and run_jit._cache_size() == 2
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[1], outs[2])


@pytest.mark.parametrize("sampler", FLOW_SAMPLERS)
def test_run_matches_step_by_step_and_model_calls(sampler: str) -> None:
    cfg = SchedulerConfig.from_dict(SD3)
    spec, plan = make_spec(cfg, sampler), make_plan(cfg, sampler, 6)
    x_t = np.random.default_rng(2).standard_normal(SHAPE, dtype=np.float32)
    calls = []

    def model(x: jax.Array, t: jax.Array) -> jax.Array:
        jax.debug.callback(lambda: calls.append(1))
        return fake_model_jax(x, t)

    final = jax.jit(lambda p, n: denoise_loop(spec, model, p, n, lambda i, k: jnp.zeros(SHAPE)))(plan, x_t)
    jax.block_until_ready(final)
    jax.effects_barrier()
    _, steps = run_ours(spec, plan, x_t, np.zeros((ROWS, 1, *SHAPE), np.float32))
    np.testing.assert_allclose(np.asarray(final), steps[-1], rtol=1e-5, atol=1e-5)
    assert len(calls) == (2 * 6 - 1 if sampler == "flow_heun" else 6)
    assert spec.noise_draws_per_step == 0


@pytest.mark.parametrize("sampler", FLOW_SAMPLERS)
def test_exact_velocity_lands_on_the_data(sampler: str) -> None:
    """Along x = (1 - s) x0 + s e the velocity is (x - x0) / s; every step stays on that line."""
    cfg = SchedulerConfig.from_dict(SD3)
    target = jnp.asarray(np.linspace(-0.9, 0.9, np.prod(SHAPE), dtype=np.float32).reshape(SHAPE))

    def model(x: jax.Array, t: jax.Array) -> jax.Array:
        return (x - target) / (t / 1000.0)

    plan = make_plan(cfg, sampler, 7)
    noise = np.random.default_rng(3).standard_normal(SHAPE, dtype=np.float32)
    x = denoise_loop(make_spec(cfg, sampler), model, plan, noise, lambda i, k: jnp.zeros(SHAPE))
    np.testing.assert_allclose(np.asarray(x), np.asarray(target), atol=1e-4)


# --- which samplers a config takes ------------------------------------------------------------------


def test_sampler_lists() -> None:
    assert FLOW_SAMPLERS == ("flow_euler", "flow_heun")
    assert SAMPLERS == DIFFUSION_SAMPLERS + FLOW_SAMPLERS + EDM_SAMPLERS and len(set(SAMPLERS)) == len(SAMPLERS)
    # every sampler reproduces a diffusers class (a count here would conflict with each new sampler)
    assert set(DIFFUSERS_CLASS) == set(SAMPLERS)
    assert {"ddpm", "pndm", "dpmpp_2m_sde", "unipc"} <= set(DIFFUSION_SAMPLERS)


@pytest.mark.parametrize("d,kind", [
    ({"_class_name": EULER}, "flow"),
    ({"_class_name": HEUN, "shift": 3.0}, "flow"),
    ({"_class_name": "DDIMScheduler", "beta_schedule": "scaled_linear"}, "diffusion"),
    ({"_class_name": "EulerDiscreteScheduler"}, "diffusion"),
    ({"shift": 3.0}, "flow"),
    ({"use_dynamic_shifting": False}, "flow"),
    ({"beta_schedule": "linear"}, "diffusion"),
    ({"prediction_type": "epsilon", "use_karras_sigmas": True}, "diffusion"),
    ({}, None),
    ({"num_train_timesteps": 1000, "use_karras_sigmas": True}, None),
])
def test_config_kind(d: dict[str, Any], kind: str | None) -> None:
    cfg = SchedulerConfig.from_dict(d)
    assert config_kind(cfg) == kind
    accepted = {"flow": FLOW_SAMPLERS, "diffusion": DIFFUSION_SAMPLERS, None: SAMPLERS}[kind]
    for sampler in SAMPLERS:
        if sampler in accepted:
            make_spec(cfg, sampler)
            make_plan(cfg, sampler, 5)
        else:
            with pytest.raises(SchedulerConfigError) as info:
                make_plan(cfg, sampler, 5)
            msg = str(info.value)
            assert "\n" not in msg and msg.endswith("supported: " + ", ".join(accepted))
            with pytest.raises(SchedulerConfigError, match="supported: " + ", ".join(accepted)):
                make_spec(cfg, sampler)


def test_a_flow_plan_ignores_diffusion_keys_only_where_the_class_decides() -> None:
    """A keyless config works with either family, each with its class defaults."""
    neutral = SchedulerConfig.from_dict({"num_train_timesteps": 1000})
    np.testing.assert_array_equal(make_plan(neutral, "flow_euler", 10).sigmas,
                                  make_plan(SchedulerConfig.from_dict(SCHNELL), "flow_euler", 10).sigmas)


# --- bad input -----------------------------------------------------------------------------------


# (config dict, sampler, make_plan kwargs, text the one-line message must contain)
REFUSED: list[tuple[dict[str, Any], str, dict[str, Any], str]] = [
    (DEV, "flow_euler", {}, "mu is required with use_dynamic_shifting=True"),
    (DEV, "flow_euler", {"mu": float("nan")}, "mu=nan"),
    (DEV, "flow_euler", {"mu": "1.0"}, "mu='1.0'"),
    ({**DEV, "time_shift_type": "linear"}, "flow_euler", {"mu": 0.0}, "mu=0.0"),
    (SD3, "flow_heun", {"mu": 1.0}, "mu is not supported for sampler 'flow_heun'"),
    (SD3, "flow_heun", {"sigmas": flux_sigmas(10)}, "sigmas is not supported for sampler 'flow_heun'"),
    ({}, "euler", {"sigmas": flux_sigmas(10)}, "sigmas is not supported for sampler 'euler'"),
    ({}, "ddim", {"mu": 1.0}, "mu is not supported for sampler 'ddim'"),
    (SD3, "flow_euler", {"sigmas": flux_sigmas(9)}, "sigmas must be 10 numbers"),
    (SD3, "flow_euler", {"sigmas": np.ones((10, 1))}, "sigmas must be 10 numbers"),
    (SD3, "flow_euler", {"sigmas": np.linspace(2.0, 0.1, 10)}, "sigmas must lie in (0, 1]"),
    (SD3, "flow_euler", {"sigmas": np.linspace(1.0, 0.0, 10)}, "sigmas must lie in (0, 1]"),
    (SD3, "flow_euler", {"sigmas": [1.0, 0.5, 0.5, 0.4, 0.3, 0.2, 0.1, 0.08, 0.05, 0.01]}, "not strictly monotone"),
    (SD3, "flow_euler", {"eta": 0.5}, "eta=0.5 is only supported for sampler 'ddim' or 'tcd'"),
    ({**SD3, "stochastic_sampling": True}, "flow_euler", {}, "stochastic_sampling"),
    ({**SD3, "use_beta_sigmas": True}, "flow_euler", {}, "use_beta_sigmas"),
    ({**SD3, "use_karras_sigmas": True, "use_exponential_sigmas": True}, "flow_euler", {}, "use_exponential_sigmas"),
    ({**SD3, "time_shift_type": "cubic"}, "flow_euler", {}, "time_shift_type"),
    ({**SD3, "shift": 0.0}, "flow_euler", {}, "shift=0.0"),
    ({**SD3, "shift": -1.0}, "flow_heun", {}, "shift=-1.0"),
    ({**SD3, "shift_terminal": 1.0}, "flow_euler", {}, "shift_terminal"),
    ({**SD3, "base_image_seq_len": 0}, "flow_euler", {}, "base_image_seq_len"),
    ({**SD3, "shift": "3"}, "flow_euler", {}, "shift"),
    ({"_class_name": 3}, "flow_euler", {}, "_class_name"),
    ({"shift": 3.0, "beta_schedule": "linear"}, "flow_euler", {}, "mixes flow-matching keys (shift)"),
    ({"_class_name": "DDPMScheduler"}, "flow_heun", {}, "supported: ddpm, ddim"),
    (SD3, "ddpm", {}, "supported: flow_euler, flow_heun"),
]


@pytest.mark.parametrize("d,sampler,kwargs,text", REFUSED, ids=[f"{i}-{r[1]}" for i, r in enumerate(REFUSED)])
def test_bad_input_is_one_line(d: dict[str, Any], sampler: str, kwargs: dict[str, Any], text: str) -> None:
    with pytest.raises(SchedulerConfigError) as info:
        make_plan(SchedulerConfig.from_dict(d), sampler, 10, **kwargs)
    msg = str(info.value)
    assert text in msg and "\n" not in msg


def test_terminal_stretch_needs_two_steps() -> None:
    """diffusers divides 0 by 0 here and returns NaN sigmas; we refuse the step count."""
    with pytest.raises(SchedulerConfigError, match="steps=1 .*not strictly monotone"):
        make_plan(SchedulerConfig.from_dict({**SD3, "shift_terminal": 0.1}), "flow_euler", 1)


def test_flow_mu_bad_input() -> None:
    with pytest.raises(SchedulerConfigError, match="image_seq_len"):
        flow_mu(SchedulerConfig.from_dict(DEV), 0)
    with pytest.raises(SchedulerConfigError, match="image_seq_len"):
        flow_mu(SchedulerConfig.from_dict(DEV), 10.5)
    with pytest.raises(SchedulerConfigError, match="base_image_seq_len == max_image_seq_len"):
        flow_mu(SchedulerConfig.from_dict({**DEV, "max_image_seq_len": 256}), 1024)
    with pytest.raises(SchedulerConfigError, match="scheduler config is diffusion"):
        flow_mu(SchedulerConfig.from_dict({"_class_name": "DDIMScheduler"}), 1024)


def test_mu_without_dynamic_shifting_is_ignored_as_in_diffusers() -> None:
    """FluxPipeline passes mu to schnell too (use_dynamic_shifting=False): it changes nothing."""
    cfg = SchedulerConfig.from_dict(SCHNELL)
    a = make_plan(cfg, "flow_euler", 4, sigmas=flux_sigmas(4))
    b = make_plan(cfg, "flow_euler", 4, sigmas=flux_sigmas(4), mu=1.15)
    np.testing.assert_array_equal(a.sigmas, b.sigmas)
