"""Host side: turn (config, sampler, steps) into a fixed-shape ``Plan`` and a static ``SolverSpec``.

The split is what lets the engine compile once per model and solver: everything that depends
on the step count lives in the ``Plan`` as numpy arrays padded to ``num_train_timesteps + 1``
(a runtime argument, a pytree), and the few things that change the traced program live in the
hashable ``SolverSpec`` (a static argument). Each family's rows (diffusers' ``set_timesteps``) come
from ``_rows``; here they are checked, padded and joined.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from preheat.errors import SchedulerConfigError
from preheat.samplers._config import SchedulerConfig, check_sampler, resolve, resolve_edm, resolve_flow
from preheat.samplers._rows import (LMS_ORDER, SIGMA_SAMPLERS, Rows, check_schedule, check_zero_snr, discrete_rows,
                                    dpm_rows, edm_rows, flow_rows, lcm_rows, lms_coefficients, midpoint_rows,
                                    pndm_rows, sigma_rows, tcd_mid, train_alphas_cumprod, unipc_corrector)
from preheat.samplers._tables import EDM_SAMPLERS, FLOW_SAMPLERS, SAMPLERS

__all__ = ["SolverSpec", "Plan", "make_spec", "make_plan", "flow_mu", "strength_start", "handoff_step",
           "MU_SIGMAS_SAMPLERS",
           "ETA_SAMPLERS", "TIMESTEPS_SAMPLERS"]

_F32 = np.float32

# sampler name -> solver (the traced update rule); Karras-ness is schedule data, not code
_SOLVER_OF_SAMPLER = {
    "ddpm": "ddpm",
    "ddim": "ddim",
    "euler": "euler",
    "euler_a": "euler_a",
    "heun": "heun",
    "dpmpp_2m": "dpmpp_2m",
    "dpmpp_2m_karras": "dpmpp_2m",
    "lcm": "lcm",
    "tcd": "tcd",
    "unipc": "unipc",
    "dpmpp_2m_sde": "dpmpp_2m_sde",
    "dpmpp_2m_sde_karras": "dpmpp_2m_sde",
    "pndm": "pndm",
    "deis": "deis",
    "lms": "lms",
    "dpm2": "dpm2",
    "dpm2_a": "dpm2_a",
    "dpmpp_sde": "dpmpp_sde",
    "dpmpp_2s": "dpmpp_2s",
    "dpmpp_2s_karras": "dpmpp_2s",
    # flow matching: the same Euler / Heun updates in sigma, fed the model's velocity
    # (SolverSpec.prediction_type == "flow") instead of a derivative from an x0 estimate
    "flow_euler": "euler",
    "flow_heun": "heun",
    # EDM: the variance-exploding Euler and DPM-Solver++ updates, fed the preconditioned model's x0
    # (SolverSpec.sigma_data > 0)
    "edm_euler": "euler",
    "edm_dpmpp_2m": "dpmpp_2m",
    "edm_dpmpp_2m_sde": "dpmpp_2m_sde",
}
# Samplers whose diffusers ``set_timesteps`` takes ``mu`` and ``sigmas`` (and so make_plan).
MU_SIGMAS_SAMPLERS: tuple[str, ...] = ("flow_euler",)
_NOISE_DRAWS = {"ddpm": 1, "ddim": 1, "euler_a": 1, "lcm": 1, "tcd": 1,
                "dpmpp_2m_sde": 1,  # by solver (edm_dpmpp_2m_sde's is dpmpp_2m_sde)
                "dpm2_a": 1, "dpmpp_sde": 2}  # dpmpp_sde: one per move (its Brownian path's two increments)
# Solvers with a second model call per step (not on the last), at the Plan's mid_sigmas / mid_timesteps.
MIDPOINT_SOLVERS: tuple[str, ...] = ("dpm2", "dpm2_a", "dpmpp_sde")
# Solvers that call the model twice per step (not on the last): Heun, at the Euler point, and the midpoint ones.
TWO_CALL_SOLVERS: tuple[str, ...] = ("heun", *MIDPOINT_SOLVERS)
# Samplers whose make_plan takes a custom descending ``timesteps`` list (their diffusers
# ``set_timesteps(timesteps=...)``: Hyper-SD's 1-step cards pass ``[800]``).
TIMESTEPS_SAMPLERS: tuple[str, ...] = ("lcm", "tcd")
# Samplers whose stochasticity ``eta`` is runtime data (ddim's eta, tcd's gamma).
ETA_SAMPLERS: tuple[str, ...] = ("ddim", "tcd")


@dataclass(frozen=True)
class SolverSpec:
    """Static (hashable) solver settings; pass as a static argument to ``jax.jit``.

    Only what changes the traced program belongs here, so that two plans for the same
    model and solver share one compiled loop whatever their step count or schedule.
    """

    solver: str  # "ddpm" | "ddim" | "euler" | "euler_a" | "heun" | "dpmpp_2m" | "lcm" | "tcd" | "unipc"
    #   | "dpmpp_2m_sde" | "pndm" | "deis" | "lms" | "dpm2" | "dpm2_a" | "dpmpp_sde" | "dpmpp_2s"
    prediction_type: str  # "epsilon" | "v_prediction" | "sample" | "flow" (velocity; euler/heun only)
    clip_sample: bool = False  # clamp the x0 prediction (ddpm, ddim, heun, lcm only)
    clip_sample_range: float = 1.0
    variance_type: str = ""  # ddpm: "fixed_small" | "fixed_small_log" | "fixed_large"
    timestep_scaling: float = 0.0  # lcm: t scale of the boundary condition c_skip(t), c_out(t)
    solver_order: int = 0  # unipc, deis: the highest order (1..3), so the predictions it carries
    solver_type: str = ""  # unipc: "bh1" | "bh2", the B(h) of its update; EDM dpm++: "midpoint" | "heun"
    #   (its second-order term; "" = midpoint)
    sigma_data: float = 0.0  # EDM samplers: the data's std, which turns on EDM's preconditioning (the state is
    #   variance exploding, the model sees c_in x at c_noise and its output gives x0 = c_skip x + c_out F); 0 = none

    @property
    def noise_draws_per_step(self) -> int:
        """How many ``noise_fn(i, k)`` draws one step makes (k = 0 .. n - 1).

        ddim draws even at ``eta == 0`` (eta is runtime data) and multiplies the draw by 0;
        lcm and tcd draw on their last step too and drop the draw there (the step count is data;
        tcd at ``eta == 0`` drops every draw); so does dpmpp_2m_sde (its last step lands on sigma 0,
        where the draw's coefficient is 0), as diffusers draws there too.
        """
        return _NOISE_DRAWS.get(self.solver, 0)

    @property
    def max_model_calls_per_step(self) -> int:
        """Heun and the midpoint solvers (DPM2, DPM2 a, DPM++ SDE) evaluate the model twice per step except on
        the last one."""
        return 2 if self.solver in TWO_CALL_SOLVERS else 1


class Plan(NamedTuple):
    """Per-step schedule data, padded to ``num_train_timesteps + 1`` rows (a pytree).

    Row ``i`` describes step ``i``; rows ``>= n_steps`` (and ``n_steps`` itself, except for
    ``sigmas`` where it holds the final 0) are padding that the solvers never read.
    Fields a solver does not use hold harmless padding (zeros / ones).
    """

    n_steps: np.ndarray  # int32 []: steps to run (a traced trip count)
    timesteps: np.ndarray  # float32 [L]: the t the model sees at step i
    sigmas: np.ndarray  # float32 [L]: sigma_i (sigma-space samplers); sigmas[n_steps] = 0 (1: invert_sigmas)
    alpha_bar: np.ndarray  # float32 [L]: alphas_cumprod at t_i (ddpm, ddim, lcm, tcd)
    alpha_bar_prev: np.ndarray  # float32 [L]: alphas_cumprod at the step's target (ddpm, ddim, lcm, tcd)
    order: np.ndarray  # int32 [L]: dpm++ / unipc (predictor) / deis order of step i (dpm++: 1 or 2; else 1..3)
    init_noise_sigma: np.ndarray  # float32 []: scale of the standard-normal start noise
    eta: np.ndarray  # float32 []: ddim / tcd stochasticity (0 = deterministic)
    alpha_bar_mid: np.ndarray  # float32 [L]: tcd: alphas_cumprod at s_i = floor((1 - eta) * t_next);
    #   pndm: at t_i + T // steps (the step its counter-1 call restarts from); else 1
    corrector: np.ndarray  # bool [L]: unipc: step i first corrects the sample step i - 1 made (else False)
    progress_id: np.ndarray = np.int32(0)  # int32 []: whose call the step reports are (preheat.progress)
    lms_coeffs: np.ndarray = np.zeros((1, LMS_ORDER), np.float32)  # float32 [L, 4]: lms: step i's weights of
    #   the derivatives of steps i, i-1, i-2, i-3 (zeros elsewhere; make_plan always fills all L rows)
    mid_sigmas: np.ndarray = np.zeros(1, np.float32)  # float32 [L]: MIDPOINT_SOLVERS: the log-midpoint of sigma_i
    #   and sigma_{i+1} (dpm2_a: of sigma_i and its sigma_down), where the second model call is (0 on the last
    #   step: no second call); zeros elsewhere
    mid_timesteps: np.ndarray = np.zeros(1, np.float32)  # float32 [L]: the model's t at mid_sigmas[i]


def make_spec(config: SchedulerConfig, sampler: str) -> SolverSpec:
    """The static solver settings for ``sampler`` under ``config``."""
    check_sampler(config, sampler)
    if sampler in FLOW_SAMPLERS:
        resolve_flow(config, sampler)  # refuses what we do not implement
        return SolverSpec(solver=_SOLVER_OF_SAMPLER[sampler], prediction_type="flow")
    if sampler in EDM_SAMPLERS:
        e = resolve_edm(config, sampler)
        return SolverSpec(solver=_SOLVER_OF_SAMPLER[sampler], prediction_type=e.prediction_type,
                          solver_type=e.solver_type, sigma_data=e.sigma_data)
    r = resolve(config, sampler)
    return SolverSpec(
        solver=_SOLVER_OF_SAMPLER[sampler],
        prediction_type=r.prediction_type,
        clip_sample=r.clip_sample,
        clip_sample_range=r.clip_sample_range if r.clip_sample else 1.0,
        variance_type=r.variance_type,
        timestep_scaling=r.timestep_scaling,
        solver_order=r.solver_order,
        solver_type=r.solver_type,
    )


def make_plan(config: SchedulerConfig, sampler: str, steps: int, *, eta: float = 0.0, mu: float | None = None,
              sigmas: "np.ndarray | list[float] | None" = None,
              timesteps: "np.ndarray | Sequence[int] | None" = None) -> Plan:
    """Schedule ``steps`` steps of ``sampler``, with diffusers' numbers, into a padded ``Plan``.

    ``mu`` and ``sigmas`` are what a pipeline passes to ``set_timesteps`` (flow_euler only,
    as only FlowMatchEulerDiscreteScheduler takes them): ``mu`` is required with
    ``use_dynamic_shifting`` (see :func:`flow_mu`) and ignored without it, as diffusers does;
    ``sigmas`` are custom sigmas in (0, 1], one per step (Flux passes ``flux_sigmas(steps)``),
    shifted like the default ones. ``timesteps`` (lcm, tcd: :data:`TIMESTEPS_SAMPLERS`) are custom
    descending training timesteps, one per step, used as given (``set_timesteps(timesteps=...)``).
    """
    check_sampler(config, sampler)
    if timesteps is not None and sampler not in TIMESTEPS_SAMPLERS:
        raise SchedulerConfigError.about("{0} is not supported for {1} {sampler!r}; only {takes} take it", "timesteps",
                                         "sampler", sampler=sampler, takes=", ".join(TIMESTEPS_SAMPLERS))
    if sampler not in MU_SIGMAS_SAMPLERS:
        for name, value in (("mu", mu), ("sigmas", sigmas)):
            if value is not None:
                raise SchedulerConfigError(
                    f"{name} is not supported for sampler {sampler!r}; only {', '.join(MU_SIGMAS_SAMPLERS)} takes it"
                )
    if sampler in FLOW_SAMPLERS:
        fr = resolve_flow(config, sampler)
        steps = _check_steps(steps, fr.num_train_timesteps)
        _check_eta(sampler, float(eta))
        rows = flow_rows(fr, steps, mu, sigmas)
        return _pad(fr.num_train_timesteps, rows, 0.0)
    if sampler in EDM_SAMPLERS:
        er = resolve_edm(config, sampler)
        steps = _check_steps(steps, er.num_train_timesteps)
        _check_eta(sampler, float(eta))
        return _pad(er.num_train_timesteps, edm_rows(er, steps), 0.0)
    r = resolve(config, sampler)
    T = r.num_train_timesteps
    steps = _check_steps(steps, T)
    eta = float(eta)
    _check_eta(sampler, eta)

    alpha_bar_train = train_alphas_cumprod(r)
    ramp = None  # the sigma samplers' float64 sigmas, before the float32 cast
    if sampler in ("ddpm", "ddim"):
        rows = discrete_rows(r, steps, alpha_bar_train)
    elif sampler in ("lcm", "tcd"):
        rows = lcm_rows(r, steps, alpha_bar_train, timesteps)
    elif sampler.startswith(("dpmpp_2m", "dpmpp_2s")) or sampler in ("unipc", "deis"):
        rows = dpm_rows(r, steps, alpha_bar_train)
    elif sampler == "pndm":
        rows, mid = pndm_rows(r, steps, alpha_bar_train)  # checks its own (repeating) schedule
        return _pad(T, rows, eta, mid)
    else:
        rows, ramp = sigma_rows(r, steps, alpha_bar_train)
    timesteps, sched_sigmas = rows[0], rows[1]
    check_schedule(r, steps, timesteps, sched_sigmas if sampler in SIGMA_SAMPLERS else None)
    check_zero_snr(r, timesteps, rows[2])
    mid = tcd_mid(timesteps, eta, alpha_bar_train) if sampler == "tcd" else None
    corrector = unipc_corrector(r, len(timesteps)) if sampler == "unipc" else None
    lms = lms_coefficients(sched_sigmas) if sampler == "lms" else None
    midpoints = midpoint_rows(sampler, sched_sigmas, ramp, alpha_bar_train) if sampler in MIDPOINT_SOLVERS else None
    return _pad(T, rows, eta, mid, corrector, lms, midpoints)


def flow_mu(config: SchedulerConfig, image_seq_len: int) -> float:
    """``mu`` for ``use_dynamic_shifting``: diffusers' pipelines' ``calculate_shift``.

    Linear in the image's token count, through (base_image_seq_len, base_shift) and
    (max_image_seq_len, max_shift) of the config (class defaults where absent). Flux counts
    packed 2x2 latent tokens, SD3 patches: the family computes ``image_seq_len``.
    """
    fr = resolve_flow(config, "flow_euler")
    if isinstance(image_seq_len, bool) or not isinstance(image_seq_len, (int, np.integer)) or image_seq_len < 1:
        raise SchedulerConfigError(f"image_seq_len={image_seq_len!r} must be an int >= 1")
    base_seq_len, max_seq_len = fr.base_image_seq_len, fr.max_image_seq_len
    if base_seq_len == max_seq_len:
        raise SchedulerConfigError(
            f"base_image_seq_len == max_image_seq_len == {base_seq_len}: the shift for mu is undefined"
        )
    # calculate_shift, operation for operation (Python floats)
    m = (fr.max_shift - fr.base_shift) / (max_seq_len - base_seq_len)
    b = fr.base_shift - m * base_seq_len
    return int(image_seq_len) * m + b


def strength_start(steps: int, strength: float, rule: str = "sd") -> int:
    """The first step an img2img call runs: diffusers' ``get_timesteps(steps, strength)``, whose
    ``t_start * scheduler.order`` is this step of a ``Plan`` (Heun's and DPM2's two calls are one step here).

    "sd" (SD 1.x/2.x, SDXL): ``steps - min(int(steps * strength), steps)``; "flow" (Flux, SD3):
    ``int(steps - min(steps * strength, steps))`` -- the cast after the subtraction, not before.
    A start that leaves no step to run is refused (diffusers would index an empty schedule).
    """
    if rule == "sd":
        start = max(steps - min(int(steps * strength), steps), 0)
    elif rule == "flow":
        start = int(max(steps - min(steps * strength, steps), 0))
    else:
        raise SchedulerConfigError(f"unknown strength rule {rule!r}; use 'sd' or 'flow'")
    if start >= steps:
        raise SchedulerConfigError.about("{0}={strength} with {1}={steps} runs no step; raise {0} or {1}", "strength",
                                         "steps", strength=strength, steps=steps)
    return start


def handoff_step(plan: Plan, num_train_timesteps: int, fraction: float) -> int:
    """The step at which a second pipeline takes over: diffusers' ``denoising_end`` (the first
    pipeline keeps the steps whose timestep is at or above ``round(T - fraction * T)``) and the
    second's ``denoising_start`` (it runs the rest) with the same fraction. Steps run in order,
    so with falling timesteps this is how many the first runs (0 .. ``plan.n_steps``)."""
    cutoff = int(round(num_train_timesteps - fraction * num_train_timesteps))
    timesteps = np.asarray(plan.timesteps[:int(plan.n_steps)], np.float64)
    return int(np.sum(timesteps >= cutoff))


def _check_steps(steps: object, T: int) -> int:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
        raise SchedulerConfigError(f"steps={steps!r} must be an int in [1, {T}]")
    steps = int(steps)
    if not 1 <= steps <= T:
        raise SchedulerConfigError.about("{0}={steps} is not supported; it must be in [1, {T}] (num_train_timesteps)",
                                         "steps", steps=steps, T=T)
    return steps


def _check_eta(sampler: str, eta: float) -> None:
    if sampler not in ETA_SAMPLERS and eta != 0.0:
        raise SchedulerConfigError.about("{0}={eta} is only supported for {1} {takes}; use {0}=0.0 for {1} {sampler!r}",
                                         "eta", "sampler", eta=eta, takes=" or ".join(map(repr, ETA_SAMPLERS)),
                                         sampler=sampler)
    if not 0.0 <= eta <= 1.0:
        raise SchedulerConfigError.about("{0}={eta} is not supported; it must be in [0, 1]", "eta", eta=eta)


def _pad(T: int, rows: Rows, eta: float, mid: np.ndarray | None = None,
         corrector: np.ndarray | None = None, lms: np.ndarray | None = None,
         midpoints: tuple[np.ndarray, np.ndarray] | None = None) -> Plan:
    """The padded ``Plan`` (``T + 1`` rows whatever the step count) of one schedule (``mid``:
    tcd's alpha_bar_mid rows; ``corrector``: unipc's; ``lms``: lms's coefficient rows; ``midpoints``:
    dpm2's (sigmas, timesteps))."""
    timesteps, sigmas, ab, ab_prev, order, init_sigma = rows
    L = T + 1

    def pad(values: np.ndarray, fill: float, dtype: type) -> np.ndarray:
        out = np.full((L, *np.shape(values)[1:]), fill, dtype=dtype)  # [L] or [L, ...]: rows past the steps
        out[: len(values)] = values
        return out

    return Plan(
        n_steps=np.asarray(len(timesteps), dtype=np.int32),
        timesteps=pad(timesteps, 0.0, _F32),
        sigmas=pad(sigmas, 0.0, _F32),
        alpha_bar=pad(ab, 1.0, _F32),
        alpha_bar_prev=pad(ab_prev, 1.0, _F32),
        order=pad(order, 1, np.int32),
        init_noise_sigma=np.asarray(init_sigma, dtype=_F32),
        eta=np.asarray(eta, dtype=_F32),
        alpha_bar_mid=pad(np.ones(0, _F32) if mid is None else mid, 1.0, _F32),
        corrector=pad(np.zeros(0, bool) if corrector is None else corrector, False, np.bool_),
        lms_coeffs=pad(np.zeros((0, LMS_ORDER), _F32) if lms is None else lms, 0.0, _F32),
        mid_sigmas=pad(np.zeros(0, _F32) if midpoints is None else midpoints[0], 0.0, _F32),
        mid_timesteps=pad(np.zeros(0, _F32) if midpoints is None else midpoints[1], 0.0, _F32),
    )



assert set(_SOLVER_OF_SAMPLER) == set(SAMPLERS)
