"""Shared helpers for the sampler tests: a fake model in jax and torch, and drivers that run
diffusers' schedulers and ours step by step on the same inputs and noise."""

from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import diffusers
from diffusers.schedulers import (
    scheduling_ddim,
    scheduling_ddpm,
    scheduling_deis_multistep,
    scheduling_dpmsolver_multistep,
    scheduling_dpmsolver_sde,
    scheduling_edm_dpmsolver_multistep,
    scheduling_euler_ancestral_discrete,
    scheduling_k_dpm_2_ancestral_discrete,
    scheduling_lcm,
    scheduling_tcd,
)

from preheat.samplers import EDM_SAMPLERS, Plan, SamplerState, SchedulerConfig, SolverSpec, _schedules
from preheat.samplers import init, make_plan, make_spec, step
from tests._support.numerics import assert_within_ulps, correctly_rounded_f32

SHAPE = (2, 3, 8, 8)
RTOL = ATOL = 1e-5
FLOOR_FACTOR = 4.0  # allowed multiple of diffusers' own float32 noise floor (see test_sampler_parity)

DIFFUSERS_CLASS = {
    "ddpm": diffusers.DDPMScheduler,
    "ddim": diffusers.DDIMScheduler,
    "euler": diffusers.EulerDiscreteScheduler,
    "euler_a": diffusers.EulerAncestralDiscreteScheduler,
    "heun": diffusers.HeunDiscreteScheduler,
    "dpmpp_2m": diffusers.DPMSolverMultistepScheduler,
    "dpmpp_2m_karras": diffusers.DPMSolverMultistepScheduler,
    "lcm": diffusers.LCMScheduler,
    "tcd": diffusers.TCDScheduler,
    "unipc": diffusers.UniPCMultistepScheduler,
    "dpmpp_2m_sde": diffusers.DPMSolverMultistepScheduler,
    "dpmpp_2m_sde_karras": diffusers.DPMSolverMultistepScheduler,
    "pndm": diffusers.PNDMScheduler,
    "deis": diffusers.DEISMultistepScheduler,
    "lms": diffusers.LMSDiscreteScheduler,
    "dpm2": diffusers.KDPM2DiscreteScheduler,
    "dpm2_a": diffusers.KDPM2AncestralDiscreteScheduler,
    "dpmpp_sde": diffusers.DPMSolverSDEScheduler,
    "dpmpp_2s": diffusers.DPMSolverSinglestepScheduler,
    "dpmpp_2s_karras": diffusers.DPMSolverSinglestepScheduler,
    "edm_euler": diffusers.EDMEulerScheduler,
    "edm_dpmpp_2m": diffusers.EDMDPMSolverMultistepScheduler,
    "edm_dpmpp_2m_sde": diffusers.EDMDPMSolverMultistepScheduler,
}
# modules whose ``randn_tensor`` we replace so diffusers draws our noise table
RANDN_MODULES = (scheduling_ddpm, scheduling_ddim, scheduling_euler_ancestral_discrete, scheduling_lcm, scheduling_tcd,
                 scheduling_dpmsolver_multistep, scheduling_edm_dpmsolver_multistep,
                 scheduling_k_dpm_2_ancestral_discrete)


# --- the fake denoiser, identical math in jax and torch -------------------------------------------


def fake_model_jax(x: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.tanh(0.7 * x + 0.001 * t) * 0.9 + 0.05 * jnp.sin(x)


def fake_model_torch(x: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    t = torch.as_tensor(t).to(torch.float32)
    return torch.tanh(0.7 * x + 0.001 * t) * 0.9 + 0.05 * torch.sin(x)


# --- inputs ------------------------------------------------------------------------------------


def noise_for(seed: int, n_rows: int, shape: tuple[int, ...] = SHAPE, draws: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Initial standard-normal noise ``[*shape]`` and a per-step table ``[n_rows, draws, *shape]``."""
    rng = np.random.default_rng(seed)
    x_t = rng.standard_normal(shape, dtype=np.float32)
    table = rng.standard_normal((n_rows, max(draws, 1), *shape), dtype=np.float32)
    return x_t, table


def diffusers_scheduler(sampler: str, cfg: dict[str, Any]):
    """The diffusers scheduler a pipeline would build with ``Class.from_config(cfg)``."""
    cls = DIFFUSERS_CLASS[sampler]
    extra: dict[str, Any] = {}
    if sampler.startswith("dpmpp_2m"):
        extra = dict(algorithm_type="sde-dpmsolver++" if "_sde" in sampler else "dpmsolver++", solver_order=2,
                     solver_type="midpoint", lower_order_final=True, use_karras_sigmas=sampler.endswith("_karras"))
    elif sampler.startswith("dpmpp_2s"):  # the name fixes these, as for dpmpp_2m
        extra = dict(algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint", lower_order_final=True,
                     use_karras_sigmas=sampler.endswith("_karras"))
    elif sampler.startswith("edm_dpmpp"):  # the name fixes the algorithm, the config the rest
        extra = dict(algorithm_type="sde-dpmsolver++" if "_sde" in sampler else "dpmsolver++")
    elif sampler == "pndm":
        extra = dict(skip_prk_steps=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_config(dict(cfg), **extra)


# --- diffusers reference trajectory ----------------------------------------------------------


@dataclass
class Trajectory:
    timesteps: np.ndarray  # model timesteps of the n steps (Heun: the first-stage ones)
    sigmas: np.ndarray | None  # n + 1 sigmas (sigma samplers)
    init_noise_sigma: float
    x_init: np.ndarray
    xs: list[np.ndarray]  # sample after each of our steps


def _nudge(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Move every element one float32 ulp up or down at random (a float64 tensor too: by its float32 ulp)."""
    up = torch.rand(x.shape, generator=gen) < 0.5
    if x.dtype == torch.float64:
        ulp = torch.from_numpy(np.spacing(np.abs(x.numpy()).astype(np.float32)).astype(np.float64))
        return x + torch.where(up, ulp, -ulp)
    return torch.nextafter(x, torch.where(up, torch.tensor(np.inf), torch.tensor(-np.inf)))


def _rounded_at(x: torch.Tensor, scale: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``x`` moved up or down at random by one float32 ulp of ``|scale|`` per element: a step
    ``x + d * dt`` whose terms are of the entering sample's size rounds there (an FMA, or another
    order, moves its result by that much), which nudging the sample itself cannot show where the
    step contracts it (zero-terminal-SNR Euler's first step from sigma ~4096)."""
    up = torch.rand(x.shape, generator=gen) < 0.5
    ulp = torch.from_numpy(np.spacing(np.abs(scale.numpy()).astype(np.float32)).astype(x.numpy().dtype))
    return x + torch.where(up, ulp, -ulp)


class _NudgedTranscendentals:
    """The ``torch`` (or ``np``) a scheduler module sees in a nudged run: ``log`` and ``exp`` results
    one ulp off at random, everything else the module's own. For updates whose coefficients are
    differences of the schedule's logarithms (DEIS: its first order multiplies ``exp(h)``, ~4600
    leaving sigma ~2e4 of a cosine schedule, by the sample's scale; its third order subtracts
    products of logs of about 10): one ulp of a logarithm -- what torch's, numpy's and XLA's may
    differ by -- moves the result by many of the sample's ulps, a floor nudging the sample cannot show."""

    def __init__(self, base: Any, gen: torch.Generator) -> None:
        self._base, self._gen = base, gen

    def log(self, x: Any) -> torch.Tensor:
        return _nudge(torch.as_tensor(self._base.log(x)), self._gen)

    def exp(self, x: Any) -> torch.Tensor:
        return _nudge(torch.as_tensor(self._base.exp(x)), self._gen)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


# samplers with a second model call per step whose diffusers schedule interleaves the second calls' timesteps
TWO_CALL_SAMPLERS = ("dpm2", "dpm2_a", "dpmpp_sde")
# Samplers compared with diffusers' own code run in float64 (``run_diffusers(float64=True)``), not its float32
# run: their ancestral split's float32 ``sigma_down = sqrt(sigma_to^2 - sigma_up^2)`` cancels, by up to
# (sigma / sigma_to)^2 (~1e7 on a cosine schedule's first step from ~2e4), where ours does not
# (_core.ancestral_split). There diffusers' float32 sigma_down is off by percents (KDPM2Ancestral then
# puts its midpoint 3.5% away, or at NaN), a rounding the floor of a nudged sample cannot show. The float64
# run has none of it; ours, in float32, must be as close to it as the float32 floor allows: the larger of the
# float32 run's and the float64 run's nudged by float32 ulps (_nudge), which is defined where the float32 is NaN.
FLOAT64_REFERENCE = ("euler_a", "dpm2_a", "dpmpp_sde")
# scheduler modules whose log/exp (torch's and numpy's) a nudged run perturbs too (_NudgedTranscendentals)
TRANSCENDENTAL_NUDGED = {"deis": scheduling_deis_multistep}


class _Float64Numpy:
    """The ``np`` a scheduler module sees while a float64 reference builds its tables: ``np.float32`` is
    float64 (``.astype(np.float32)``, ``linspace(dtype=np.float32)``), everything else numpy's own."""

    float32 = np.float64

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


class _TablePath:
    """DPMSolverSDEScheduler's noise sampler: normalised increments of one Brownian path ``W(sigma)``, here
    built from the table instead of torchsde's tree. A step's first call asks for the increment over
    ``[sigma_mid, sigma]`` and gets ``table[i, 0]``; its second, over ``[sigma_next, sigma]``, gets that
    increment plus an independent one over ``[sigma_next, sigma_mid]`` (``table[i, 1]``), normalised: the
    path's own addition, not the solver's correlated-draw formula. ``independent`` (a negative control):
    the second increment ignores the first, as two unrelated draws would."""

    independent = False

    def __init__(self, table: np.ndarray, current: dict[str, int]) -> None:
        self._table, self._current, self._mid = table, current, 0.0

    def __call__(self, sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        step = self._table[self._current["step"]].astype(np.float64)  # [2, *S]
        s, t = float(sigma), float(sigma_next)
        if not self._current["second"]:
            self._mid = t
            return torch.from_numpy(step[0]).to(sigma.dtype)
        if self.independent:
            return torch.from_numpy(step[1]).to(sigma.dtype)
        w = np.sqrt(s - self._mid) * step[0] + np.sqrt(self._mid - t) * step[1]  # W(sigma_next) - W(sigma), sign aside
        return torch.from_numpy(w / np.sqrt(s - t)).to(sigma.dtype)


def run_diffusers(sampler: str, cfg: dict[str, Any], steps: int, x_t: np.ndarray, table: np.ndarray,
                  monkeypatch, *, eta: float = 0.0, nudge_seed: int | None = None,
                  model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = fake_model_torch,
                  timesteps: list[int] | None = None, float64: bool = False) -> Trajectory:
    """Run diffusers like its pipelines do, recording the sample after each of *our* steps.

    ``randn_tensor`` is replaced so that step ``i``'s k-th draw is ``table[i, k]``; for dpmpp_sde the
    BrownianTree noise sampler is too, by one Brownian path built from the table (:class:`_TablePath`).
    For euler_a with ``prediction_type="sample"`` (which diffusers' class rejects) the
    scheduler runs with "epsilon" and is fed the epsilon equivalent of the model's x0.
    With ``nudge_seed``, the sample entering every call and every model output are moved by
    one ulp (and, for TRANSCENDENTAL_NUDGED samplers, the step's log and exp results), and each
    step's result by one ulp of the sample it took in (:func:`_rounded_at`): the spread this causes
    is the float32 rounding noise floor of the trajectory.
    ``timesteps``: a custom list, given to ``set_timesteps(timesteps=...)`` instead of ``steps``.
    ``float64``: run diffusers' own code in float64 (samples, noise and the scheduler's float32 tables cast
    up): the trajectory without its float32 rounding, schedule arithmetic included.
    """
    gen = None if nudge_seed is None else torch.Generator().manual_seed(nudge_seed)
    pred = cfg.get("prediction_type", "epsilon")
    emulate_sample = sampler == "euler_a" and pred == "sample"
    sched = diffusers_scheduler(sampler, {**cfg, "prediction_type": "epsilon"} if emulate_sample else cfg)
    with pytest.MonkeyPatch.context() as local:
        if float64:  # the tables set_timesteps builds in float32, in float64
            module = sys.modules[type(sched).__module__]
            local.setattr(module, "np", _Float64Numpy())
        if timesteps is None:
            sched.set_timesteps(steps)
        else:
            with warnings.catch_warnings():  # a list off the distillation grid is a warning in diffusers
                warnings.simplefilter("ignore")
                sched.set_timesteps(timesteps=timesteps)
    ts = sched.timesteps
    sig = getattr(sched, "sigmas", None)
    if sampler == "heun":  # diffusers lists [t0, t1, t1, t2, t2, ...]: one entry per model call
        ts_ours = torch.cat([ts[:1], ts[1::2]])
        sig_ours = torch.cat([sig[:1], sig[1::2]])
    elif sampler in TWO_CALL_SAMPLERS:  # [t0, t_mid0, t1, t_mid1, ..., t_last], sigmas [s0, s1, s1, s2, s2, .., 0]
        ts_ours = ts[0::2]
        sig_ours = torch.cat([sig[0::2][: len(ts_ours)], sig[-1:]])
    else:
        ts_ours, sig_ours = ts, sig
    if sampler == "dpmpp_sde":  # float64, fractional with linspace: the UNet's time embedding takes float32
        ts_ours = ts_ours.to(torch.float32)
    if int((ts == ts[0]).sum()) > 1 and hasattr(sched, "set_begin_index"):
        # A repeated first timestep sends diffusers' step-index lookup to the second copy (Heun's
        # [t0, t0, ...]; dpm2's [999, 998.8, 999, ...] with a cosine Karras schedule): the run then skips
        # steps or crashes at its end (IndexError); pin the intended start.
        sched.set_begin_index(0)

    current = {"step": 0, "k": 0, "second": 0}
    if float64:
        for name, value in list(vars(sched).items()):
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32 and name != "timesteps":
                setattr(sched, name, value.double())

    def fake_randn(shape, generator=None, device=None, dtype=None, layout=None):
        out = torch.from_numpy(table[current["step"], current["k"]].copy())
        current["k"] += 1
        assert tuple(out.shape) == tuple(shape)
        return out.to(dtype or torch.float32)

    for mod in RANDN_MODULES:
        monkeypatch.setattr(mod, "randn_tensor", fake_randn)
    monkeypatch.setattr(scheduling_dpmsolver_sde, "BrownianTreeNoiseSampler",
                        lambda *args, **kwargs: _TablePath(table, current))
    with pytest.MonkeyPatch.context() as local:  # undone before the next run
        if gen is not None and sampler in TRANSCENDENTAL_NUDGED:
            for name, base in (("torch", torch), ("np", np)):
                local.setattr(TRANSCENDENTAL_NUDGED[sampler], name, _NudgedTranscendentals(base, gen))
        x_t = x_t.astype(np.float64) if float64 else x_t
        x_init, xs = _diffusers_loop(sampler, sched, ts, x_t, gen, model, emulate_sample, eta, current)
    return Trajectory(
        timesteps=ts_ours.numpy().astype(np.float64),
        sigmas=None if sig_ours is None or sampler in ("ddpm", "ddim", "lcm", "tcd") else sig_ours.numpy(),
        init_noise_sigma=float(torch.as_tensor(sched.init_noise_sigma).to(torch.float32)),
        x_init=x_init,
        xs=xs,
    )


def _diffusers_loop(sampler: str, sched: Any, ts: torch.Tensor, x_t: np.ndarray, gen: torch.Generator | None,
                    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], emulate_sample: bool, eta: float,
                    current: dict[str, int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """``run_diffusers``' pipeline loop: the initial sample and the sample after each of our steps
    (``current`` tells its ``randn_tensor`` which draw is due)."""
    x = torch.from_numpy(x_t.copy()) * sched.init_noise_sigma
    x_init = x.numpy().copy()
    xs: list[np.ndarray] = []
    n_calls = len(ts)
    # a generator of its own: the sample's and the model output's nudges stay those of ``gen``
    rounding = None if gen is None else torch.Generator().manual_seed(int(gen.initial_seed()) + 10_000)
    with torch.no_grad():  # (DEIS's per-step NumPy 2 warnings: pyproject's filterwarnings)
        for call, t in enumerate(ts):
            if sampler in TWO_CALL_SAMPLERS:  # [first call of step 0, its second, first of step 1, ...]
                current["step"], current["second"] = divmod(call, 2)
            else:  # (Heun draws no noise)
                current["step"] = call if sampler != "heun" else (call + 1) // 2
            current["k"] = 0
            if gen is not None:
                x = _nudge(x, gen)
            z = sched.scale_model_input(x, t)
            out = model(z, t)
            if gen is not None:
                out = _nudge(out, gen)
            if emulate_sample:
                sigma = sched.sigmas[sched.step_index]
                out = (x - out) / sigma  # epsilon with the same x0 = out
            kwargs = {"eta": eta} if sampler in ("ddim", "tcd") else {}  # tcd's own default is 0.3
            entering = x
            x = sched.step(out, t, x, **kwargs).prev_sample
            if rounding is not None:  # the step's own roundings: at the scale of the sample it took in, per element
                x = _rounded_at(x, entering, rounding)
            if sampler not in ("heun", *TWO_CALL_SAMPLERS) or call % 2 == 1 or call == n_calls - 1:
                xs.append(x.numpy().copy())
    return x_init, xs


# --- our trajectory --------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _jit_step(spec: SolverSpec, plan: Plan, state: SamplerState, i: jax.Array, table: jax.Array) -> SamplerState:
    return step(spec, fake_model_jax, plan, state, i, lambda j, k: table[j, k])


def run_ours(spec: SolverSpec, plan: Plan, x_t: np.ndarray, table: np.ndarray, *, jit: bool = True,
             model=fake_model_jax) -> tuple[np.ndarray, list[np.ndarray]]:
    """Our ``init`` + ``step`` one step at a time; returns the initial sample and each step's."""
    state = init(spec, plan, jnp.asarray(x_t))
    x_init = np.asarray(state.x)
    jtable = jnp.asarray(table)
    xs = []
    for i in range(int(plan.n_steps)):
        if jit and model is fake_model_jax:
            state = _jit_step(spec, plan, state, jnp.int32(i), jtable)
        else:
            state = step(spec, model, plan, state, i, lambda j, k: jtable[j, k])
        xs.append(np.asarray(state.x))
    return x_init, xs


def torch_train_sigmas(alpha_bar: np.ndarray) -> np.ndarray:
    """diffusers' training sigma table, computed by torch on this machine.

    torch's float32 ``** 0.5`` is not correctly rounded on every CPU (its kernel is chosen per
    processor), so this can differ from ours (IEEE sqrt) by 1 ulp at any number of entries;
    see test_sampler_schedules. Injecting it lets the parity tests check everything
    downstream bit for bit, whatever the processor.
    """
    t = torch.from_numpy(np.asarray(alpha_bar, dtype=np.float32))
    return (((1 - t) / t) ** 0.5).numpy()


def torch_betas(schedule: str, start: float, end: float, num_train: int) -> np.ndarray:
    """diffusers' float32 betas as torch computes them on this machine (``torch.linspace``).

    Ours reproduce torch's FMA-contracted kernel bit for bit where torch dispatches to one
    (checked in test_sampler_schedules); on other processors torch may round twice. Injected,
    like the sigma table, so that the schedules downstream are compared exactly everywhere.
    """
    if schedule == "linear":
        return torch.linspace(start, end, num_train, dtype=torch.float32).numpy()
    if schedule == "scaled_linear":
        return (torch.linspace(start**0.5, end**0.5, num_train, dtype=torch.float32) ** 2).numpy()
    return _ORIGINAL_BETAS(schedule, start, end, num_train)  # float64 Python math, then float32


_ORIGINAL_BETAS = _schedules.betas


def torch_rescale_zero_terminal_snr(beta: np.ndarray) -> np.ndarray:
    """diffusers' zero-terminal-SNR betas as torch computes them on this machine: its float32 ``sqrt``
    is not correctly rounded on every CPU (on the project's AMD EPYC a fifth of random inputs land 1 ulp
    from IEEE's), and the ratios and the cumulative product that follow carry that to ~4e-6 of
    alphas_cumprod (test_sampler_schedules bounds ours against it). Injected like the tables above."""
    from diffusers.schedulers.scheduling_ddim import rescale_zero_terminal_snr

    return rescale_zero_terminal_snr(torch.from_numpy(np.asarray(beta, np.float32))).numpy()


def inject_torch_tables(monkeypatch) -> None:
    """Make ``make_plan`` start from torch's own betas, training sigmas and zero-SNR rescale (see above)."""
    monkeypatch.setattr(_schedules, "train_sigmas", torch_train_sigmas)
    monkeypatch.setattr(_schedules, "betas", torch_betas)
    monkeypatch.setattr(_schedules, "rescale_zero_terminal_snr", torch_rescale_zero_terminal_snr)


def check_init_noise_sigma(plan: Plan, theirs: float, *, spec_sampler: str) -> None:
    """Ours is exact (float32 ``max``, or ``sqrt(max * max + 1)`` correctly rounded); torch's
    ``(max ** 2 + 1) ** 0.5`` is within 1 ulp of it on any CPU."""
    n = int(plan.n_steps)
    ours = np.float32(plan.init_noise_sigma)
    top = np.float32(plan.sigmas[: n + 1].max()) if spec_sampler in ("euler", "euler_a", "heun") else None
    if top is not None and ours != top:  # the "leading" case: sqrt(top^2 + 1)
        q = np.float32(top * top + np.float32(1.0))  # two IEEE float32 operations, as diffusers
        assert ours == correctly_rounded_f32(np.sqrt(np.float64(q)))
    assert_within_ulps(ours, np.float32(theirs), 1, "init_noise_sigma")


def ours_for(cfg: dict[str, Any], sampler: str, steps: int, eta: float = 0.0,
             timesteps: list[int] | None = None) -> tuple[SolverSpec, Plan]:
    config = SchedulerConfig.from_dict(cfg)
    return make_spec(config, sampler), make_plan(config, sampler, steps, eta=eta, timesteps=timesteps)


def max_errors(ours: list[np.ndarray], theirs: list[np.ndarray]) -> tuple[float, float]:
    """(max abs error, max error relative to max(|theirs|, 1)) over all steps."""
    abs_err = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs))
    rel_err = max(float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1.0))) for a, b in zip(ours, theirs))
    return abs_err, rel_err


def assert_c_noise_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    """EDM's ``c_noise = log(sigma) / 4`` from sigmas within 1 ulp, each side's float32 log within 1 ulp:
    a sigma's relative ulp (<= 2**-23) moves it by <= 2**-25, each rounding by an ulp of the result
    (ulps of c_noise compare badly near sigma = 1, where it is ~0)."""
    np.testing.assert_allclose(ours, theirs, rtol=2.0**-22, atol=2.0**-25, err_msg="c_noise")


def check_parity(sampler: str, cfg: dict[str, Any], steps: int, eta: float, monkeypatch, *,
                 plan_override: Plan | None = None, spec_override: SolverSpec | None = None, jax_model=fake_model_jax,
                 torch_model=fake_model_torch, timesteps: list[int] | None = None) -> tuple[float, float]:
    """Run ours and diffusers on the same inputs; assert bitwise schedules and close samples
    (the criterion is explained in test_sampler_parity). Returns the max (abs, relative) error
    (FLOAT64_REFERENCE samplers: from diffusers' float64 run)."""
    inject_torch_tables(monkeypatch)
    spec, plan = ours_for(cfg, sampler, steps, eta, timesteps)
    if plan_override is not None:
        plan = plan_override
    if spec_override is not None:
        spec = spec_override
    x_t, table = noise_for(steps, plan.timesteps.shape[0], draws=spec.noise_draws_per_step)
    ref = run_diffusers(sampler, cfg, steps, x_t, table, monkeypatch, eta=eta, model=torch_model, timesteps=timesteps)
    n = int(plan.n_steps)

    # schedules: bitwise (float64 casts of int64 / float32 values are exact); EDM's within 1 ulp (torch's
    # float32 pow, exp and log are not correctly rounded, ours are: test_edm measures how often they differ)
    assert n == len(ref.timesteps) == len(ref.xs)
    if sampler in EDM_SAMPLERS:
        assert_within_ulps(plan.sigmas[: n + 1], ref.sigmas.astype(np.float32), 1, "sigmas")
        assert_c_noise_close(plan.timesteps[:n], ref.timesteps.astype(np.float32))
    else:
        np.testing.assert_array_equal(plan.timesteps[:n].astype(np.float64), ref.timesteps)
    if ref.sigmas is not None and sampler not in EDM_SAMPLERS:
        np.testing.assert_array_equal(plan.sigmas[: n + 1].astype(np.float64), ref.sigmas.astype(np.float64))
    check_init_noise_sigma(plan, ref.init_noise_sigma, spec_sampler=sampler)

    x_init, xs = run_ours(spec, plan, x_t, table, model=jax_model)
    # one IEEE float32 multiply on each side, by each side's own (<= 1 ulp apart) init_noise_sigma
    np.testing.assert_array_equal(x_init, x_t * np.float32(plan.init_noise_sigma))
    np.testing.assert_array_equal(ref.x_init, x_t * np.float32(ref.init_noise_sigma))

    nudged = run_diffusers(sampler, cfg, steps, x_t, table, monkeypatch, eta=eta, nudge_seed=steps + 1,
                           model=torch_model, timesteps=timesteps)
    reference, floors = ref.xs, [np.max(np.abs(a - b)) for a, b in zip(ref.xs, nudged.xs)]
    if sampler in FLOAT64_REFERENCE:
        reference = run_diffusers(sampler, cfg, steps, x_t, table, monkeypatch, eta=eta, model=torch_model,
                                  timesteps=timesteps, float64=True).xs
        nudged = run_diffusers(sampler, cfg, steps, x_t, table, monkeypatch, eta=eta, nudge_seed=steps + 1,
                               model=torch_model, timesteps=timesteps, float64=True)
        # the float32 floor where diffusers' float32 run is finite (KDPM2Ancestral's can be NaN), else 0
        floors = [max(np.nan_to_num(f32, nan=0.0), np.max(np.abs(a - b)))
                  for f32, a, b in zip(floors, reference, nudged.xs)]
    for i, (ours, theirs, floor) in enumerate(zip(xs, reference, map(float, floors))):
        np.testing.assert_allclose(
            ours, theirs, rtol=RTOL, atol=ATOL + FLOOR_FACTOR * floor,
            err_msg=f"step {i} of {n} (float32 noise floor of diffusers here: {floor:.3g})",
        )
    return max_errors(xs, reference)
