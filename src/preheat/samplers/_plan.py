"""Host side: turn (config, sampler, steps) into a fixed-shape ``Plan`` and a static ``SolverSpec``.

The split is what lets the engine compile once per model and solver: everything that depends
on the step count lives in the ``Plan`` as numpy arrays padded to ``num_train_timesteps + 1``
(a runtime argument, a pytree), and the few things that change the traced program live in the
hashable ``SolverSpec`` (a static argument).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from preheat.errors import SchedulerConfigError
from preheat.samplers import _schedules as S
from preheat.samplers._config import (ResolvedConfig, ResolvedEdmConfig, ResolvedFlowConfig, SchedulerConfig,
                                      check_sampler, resolve, resolve_edm, resolve_flow)
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
_SIGMA_SAMPLERS = ("euler", "euler_a", "heun", "dpmpp_2m", "dpmpp_2m_karras", "dpmpp_2m_sde", "dpmpp_2m_sde_karras",
                   "unipc", "deis", "lms", "dpm2", "dpm2_a", "dpmpp_sde", "dpmpp_2s", "dpmpp_2s_karras")
_NOISE_DRAWS = {"ddpm": 1, "ddim": 1, "euler_a": 1, "lcm": 1, "tcd": 1,
                "dpmpp_2m_sde": 1,  # by solver (edm_dpmpp_2m_sde's is dpmpp_2m_sde)
                "dpm2_a": 1, "dpmpp_sde": 2}  # dpmpp_sde: one per move (its Brownian path's two increments)
# Solvers with a second model call per step (not on the last), at the Plan's mid_sigmas / mid_timesteps.
MIDPOINT_SOLVERS: tuple[str, ...] = ("dpm2", "dpm2_a", "dpmpp_sde")
# Samplers whose make_plan takes a custom descending ``timesteps`` list (their diffusers
# ``set_timesteps(timesteps=...)``: Hyper-SD's 1-step cards pass ``[800]``).
TIMESTEPS_SAMPLERS: tuple[str, ...] = ("lcm", "tcd")
# lms's order: the derivatives it weighs (LMSDiscreteScheduler.step's default, which pipelines keep).
LMS_ORDER = 4
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
        return 2 if self.solver in ("heun", *MIDPOINT_SOLVERS) else 1


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
        rows = _flow_rows(fr, steps, mu, sigmas)
        return _pad(fr.num_train_timesteps, rows, 0.0)
    if sampler in EDM_SAMPLERS:
        er = resolve_edm(config, sampler)
        steps = _check_steps(steps, er.num_train_timesteps)
        _check_eta(sampler, float(eta))
        return _pad(er.num_train_timesteps, _edm_rows(er, steps), 0.0)
    r = resolve(config, sampler)
    T = r.num_train_timesteps
    steps = _check_steps(steps, T)
    eta = float(eta)
    _check_eta(sampler, eta)

    alpha_bar_train = _train_alphas_cumprod(r)
    ramp = None  # the sigma samplers' float64 sigmas, before the float32 cast
    if sampler in ("ddpm", "ddim"):
        rows = _discrete_rows(r, steps, alpha_bar_train)
    elif sampler in ("lcm", "tcd"):
        rows = _lcm_rows(r, steps, alpha_bar_train, timesteps)
    elif sampler.startswith(("dpmpp_2m", "dpmpp_2s")) or sampler in ("unipc", "deis"):
        rows = _dpm_rows(r, steps, alpha_bar_train)
    elif sampler == "pndm":
        rows, mid = _pndm_rows(r, steps, alpha_bar_train)  # checks its own (repeating) schedule
        return _pad(T, rows, eta, mid)
    else:
        rows, ramp = _sigma_rows(r, steps, alpha_bar_train)
    timesteps, sched_sigmas = rows[0], rows[1]
    _check_schedule(r, steps, timesteps, sched_sigmas if sampler in _SIGMA_SAMPLERS else None)
    _check_zero_snr(r, timesteps, rows[2])
    mid = _tcd_mid(timesteps, eta, alpha_bar_train) if sampler == "tcd" else None
    corrector = _unipc_corrector(r, len(timesteps)) if sampler == "unipc" else None
    lms = _lms_coefficients(sched_sigmas) if sampler == "lms" else None
    midpoints = _midpoints(sampler, sched_sigmas, ramp, alpha_bar_train) if sampler in MIDPOINT_SOLVERS else None
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


def _pad(T: int, rows: "_Rows", eta: float, mid: np.ndarray | None = None,
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


# --- per-family schedules -------------------------------------------------------------------
# Each returns (timesteps f32 [n], sigmas f32 [n+1] or [0], alpha_bar f32 [n],
# alpha_bar_prev f32 [n], order int32 [n], init_noise_sigma f32).

_Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.float32]


def _train_alphas_cumprod(r: ResolvedConfig) -> np.ndarray:
    """alphas_cumprod of the training schedule, float32 ``[T]``: from the betas, rescaled to zero terminal
    SNR when the config says so; then the sigma-space classes (Euler, DPM-Solver, UniPC) put its last
    entry at 2**-24 instead of 0, so that their largest sigma (~4096) is finite, as diffusers does."""
    beta = S.betas(r.beta_schedule, r.beta_start, r.beta_end, r.num_train_timesteps)
    if not r.rescale_betas_zero_snr:
        return S.alphas_cumprod(beta)
    alpha_bar = S.alphas_cumprod(S.rescale_zero_terminal_snr(beta))
    if r.sampler in _SIGMA_SAMPLERS:
        alpha_bar[-1] = _F32(2.0 ** -24)
    return alpha_bar


def _discrete_rows(r: ResolvedConfig, steps: int, alpha_bar_train: np.ndarray) -> _Rows:
    """ddpm/ddim: integer timesteps; the alpha-bar each step moves to.

    diffusers' DDPM moves to the *next listed* timestep; DDIM moves to ``t - T // steps``
    even when the spacing is not ``T // steps`` apart (linspace/trailing) -- both kept.
    """
    T = r.num_train_timesteps
    ts = S.spaced_timesteps(r.timestep_spacing, T, steps, r.steps_offset)
    if r.timestep_spacing == "linspace":
        ts = ts.round()
    ts_int = ts.astype(np.int64)
    _check_range(r, steps, ts_int)
    n = len(ts_int)
    ab = alpha_bar_train[ts_int]
    if r.sampler == "ddpm":
        prev = np.append(ts_int[1:], -1)
        final = _F32(1.0)
    else:
        prev = ts_int - T // steps
        final = _F32(1.0) if r.set_alpha_to_one else alpha_bar_train[0]
    ab_prev = np.where(prev >= 0, alpha_bar_train[np.maximum(prev, 0)], final).astype(_F32)
    return ts_int.astype(_F32), np.zeros(0, _F32), ab, ab_prev, np.ones(n, np.int32), _F32(1.0)


def _lcm_rows(r: ResolvedConfig, steps: int, alpha_bar_train: np.ndarray,
              custom: "np.ndarray | Sequence[int] | None" = None) -> _Rows:
    """lcm, tcd: integer timesteps from the distillation grid; each step re-noises to the next one.

    The last step returns the step's own estimate (its alpha_bar_prev is unused: lcm points it
    at the step's own timestep, as diffusers does).
    """
    if custom is None:
        ts_int = S.lcm_timesteps(r.num_train_timesteps, r.original_inference_steps, steps, r.sampler)
    else:
        ts_int = _custom_timesteps(custom, steps, r.num_train_timesteps)
    n = len(ts_int)
    ab = alpha_bar_train[ts_int]
    ab_prev = alpha_bar_train[np.append(ts_int[1:], ts_int[-1])]
    return ts_int.astype(_F32), np.zeros(0, _F32), ab, ab_prev.astype(_F32), np.ones(n, np.int32), _F32(1.0)


def _custom_timesteps(custom: "np.ndarray | Sequence[int]", steps: int, T: int) -> np.ndarray:
    """A card's ``timesteps=[...]`` as int64: one per step, strictly descending, in [0, T - 1]
    (diffusers raises on the order and on t >= T; a negative t would index from the end)."""
    arr = np.asarray(custom)
    if arr.ndim != 1 or len(arr) == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise SchedulerConfigError.about("{0} must be a list of ints, got {value!r}", "timesteps",
                                         value=list(np.atleast_1d(arr)))
    if len(arr) != steps:
        raise SchedulerConfigError.about("{0} has {count} entries but {1}={steps}; pass {1}={count}", "timesteps",
                                         "steps", count=len(arr), steps=steps)
    if arr.min() < 0 or arr.max() > T - 1 or np.any(np.diff(arr) >= 0):
        raise SchedulerConfigError.about("{0}={value} must strictly decrease within [0, {last}]", "timesteps",
                                         value=arr.tolist(), last=T - 1)
    return arr.astype(np.int64)


def _tcd_mid(timesteps: np.ndarray, eta: float, alpha_bar_train: np.ndarray) -> np.ndarray:
    """tcd: alphas_cumprod at each step's intermediate ``s = floor((1 - eta) * t_next)`` (``t_next``
    = 0 after the last step), float32 ``[n]``. TCDScheduler computes ``s`` in torch float32 (the
    Python float ``1 - eta`` times an int64 timestep), so we round the same way before flooring."""
    t_next = np.append(timesteps[1:], 0).astype(_F32)  # [n]
    s = np.floor(_F32(1.0 - eta) * t_next).astype(np.int64)  # float32 product, as torch
    return alpha_bar_train[s].astype(_F32)


def _pndm_rows(r: ResolvedConfig, steps: int, alpha_bar_train: np.ndarray) -> tuple[_Rows, np.ndarray]:
    """pndm (PNDMScheduler, skip_prk_steps=True): PLMS over DDIM's integer grid, its second
    timestep listed twice -- ``steps + 1`` rows (one model call each) for ``steps >= 2``.

    Each row moves from ``t_i`` to ``t_i - T // steps`` (whatever the spacing, as diffusers; below 0:
    ``set_alpha_to_one``'s final alpha). The call after a (re)start -- diffusers' counter 1 -- instead
    redoes the previous move from ``t_i + T // steps`` to ``t_i``: ``alpha_bar_mid`` holds the
    former, ``alpha_bar`` the latter. Also returns those ``alpha_bar_mid`` rows.
    """
    T = r.num_train_timesteps
    grid = S.spaced_timesteps(r.timestep_spacing, T, steps, r.steps_offset)
    if r.timestep_spacing == "linspace":
        grid = grid.round()
    grid_int = grid.astype(np.int64)  # [steps] descending
    _check_range(r, steps, grid_int)
    _check_schedule(r, steps, grid_int.astype(_F32), None)
    ts_int = grid_int if steps == 1 else np.insert(grid_int, 1, grid_int[1])  # [n]
    ratio = T // steps
    n = len(ts_int)
    ab = alpha_bar_train[ts_int]
    prev = ts_int - ratio
    final = _F32(1.0) if r.set_alpha_to_one else alpha_bar_train[0]
    ab_prev = np.where(prev >= 0, alpha_bar_train[np.maximum(prev, 0)], final).astype(_F32)
    # t_i + ratio <= T - 1 on every row a counter-1 call can reach (rows >= 1); row 0 is clamped, never read
    ab_mid = alpha_bar_train[np.minimum(ts_int + ratio, T - 1)].astype(_F32)
    return (ts_int.astype(_F32), np.zeros(0, _F32), ab, ab_prev, np.ones(n, np.int32), _F32(1.0)), ab_mid


def _sigma_rows(r: ResolvedConfig, steps: int, alpha_bar_train: np.ndarray) -> tuple[_Rows, np.ndarray]:
    """euler, euler_a, heun, lms, dpm2, dpm2_a, dpmpp_sde: float32 timesteps, sigmas interpolated linearly in t;
    and those sigmas in float64 ``[n]`` (DPMSolverSDE places its midpoint timesteps from them)."""
    T = r.num_train_timesteps
    ts = S.spaced_timesteps(r.timestep_spacing, T, steps, r.steps_offset)
    ts32 = ts.astype(_F32)  # diffusers casts before interpolating...
    if not r.use_karras_sigmas:  # with Karras they only pick the (clamped) end sigmas
        _check_range(r, steps, ts32)
    sig_train = S.train_sigmas(alpha_bar_train)
    sig = S.interp_sigmas(ts if r.sampler == "dpmpp_sde" else ts32, sig_train)  # ...except DPMSolverSDE
    if r.use_karras_sigmas:
        lo = r.sigma_min if r.sigma_min is not None else sig[-1].item()
        hi = r.sigma_max if r.sigma_max is not None else sig[0].item()
        sig = S.karras_sigmas(lo, hi, steps)
        t_frac = S.sigma_to_t(sig, np.log(sig_train))
        ts32 = (t_frac.round() if r.sampler in ("dpm2", "dpm2_a") else t_frac).astype(_F32)  # KDPM2 rounds them
    sigmas = np.append(sig, 0.0).astype(_F32)
    n = len(ts32)
    top = sigmas.max()
    # diffusers' init_noise_sigma: max sigma, or sqrt(max^2 + 1) for "leading" (float32)
    init = top if r.timestep_spacing in ("linspace", "trailing") else np.sqrt(top * top + _F32(1.0))
    ones = np.ones(n, _F32)
    return (ts32, sigmas, ones, ones, np.ones(n, np.int32), _F32(init)), sig


def _dpm_rows(r: ResolvedConfig, steps: int, alpha_bar_train: np.ndarray) -> _Rows:
    """dpm++ 2M: integer timesteps; first and last step first order, the rest second order.

    unipc: the same timesteps and sigmas (its class shares dpm++'s ``set_timesteps``, less
    ``lambda_min_clipped``; its Karras timesteps are always rounded); its order warms up one step at
    a time to ``solver_order`` and (``lower_order_final``) winds down to 1 on the last steps; with
    ``final_sigmas_type="sigma_min"`` the last sigma is the smallest of the ramp or the training table.
    deis: unipc's rows with the last sigma always that smallest one, and its wind-down only under
    15 steps (DEISMultistepScheduler's ``lower_order_final``). dpmpp_2s: dpm++'s rows (linspace, whatever
    the config's spacing: DPMSolverSinglestepScheduler takes none; Karras timesteps always rounded), its
    orders in singlestep pairs ``[1, 2]``, the last step first order (``get_order_list``).
    """
    T = r.num_train_timesteps
    sig_train = S.train_sigmas(alpha_bar_train)
    top = T
    if r.lambda_min_clipped > -np.inf:
        # lambda = log(alpha) - log(sigma), float32 as diffusers; cut the range where it falls below
        lam = (np.log(np.sqrt(alpha_bar_train)) - np.log(np.sqrt(_F32(1.0) - alpha_bar_train))).astype(_F32)
        top = T - int(np.searchsorted(lam[::-1], _F32(r.lambda_min_clipped), side="left"))
        if top < 1:
            raise SchedulerConfigError(
                f"lambda_min_clipped={r.lambda_min_clipped} clips every timestep; use a smaller value"
            )
    ts = S.spaced_timesteps(r.timestep_spacing, T, steps, r.steps_offset, top=top, extra_point=True)
    if r.timestep_spacing == "linspace":
        ts = ts.round()
    ts_int = ts.astype(np.int64)
    if r.use_karras_sigmas:
        # diffusers' dpm++ ramps between the *training* extremes, whatever the spacing
        lo = r.sigma_min if r.sigma_min is not None else sig_train[0].item()
        hi = r.sigma_max if r.sigma_max is not None else sig_train[-1].item()
        sig = S.karras_sigmas(lo, hi, steps)
        t_frac = S.sigma_to_t(sig, np.log(sig_train))
        # dpm++ 2M rounds them except on a cosine schedule...
        if r.beta_schedule != "squaredcos_cap_v2" or r.sampler in ("unipc", "deis", "dpmpp_2s_karras"):
            t_frac = t_frac.round()
        ts_int = t_frac.astype(np.int64)  # ...where the int64 cast truncates
    else:
        _check_range(r, steps, ts_int)
        sig = S.interp_sigmas(ts_int, sig_train)
    n = len(ts_int)
    ones = np.ones(n, _F32)
    if r.sampler in ("unipc", "deis"):
        last = 0.0
        if r.final_sigma_min:
            last = sig[-1] if r.use_karras_sigmas else sig_train[0]
        sigmas = np.append(sig, last).astype(_F32)
        idx = np.arange(n)
        order = np.minimum(r.solver_order, idx + 1)  # warm-up: one more stored prediction per step
        if r.lower_order_final and (r.sampler == "unipc" or n < 15):
            order = np.minimum(order, n - idx)
        return ts_int.astype(_F32), sigmas, ones, ones, order.astype(np.int32), _F32(1.0)
    sigmas = np.append(sig, 0.0).astype(_F32)
    if r.sampler.startswith("dpmpp_2s"):  # singlestep pairs: [1, 2] * ..., the last one or two steps first order
        order = np.array([1, 2] * (n // 2 - 1) + [1, 1] if n % 2 == 0 else [1, 2] * (n // 2) + [1], np.int32)
        return ts_int.astype(_F32), sigmas, ones, ones, order, _F32(1.0)
    order = np.full(n, 2, np.int32)
    order[0] = 1  # no history yet
    order[-1] = 1  # final sigma is 0: diffusers always finishes first order
    return ts_int.astype(_F32), sigmas, ones, ones, order, _F32(1.0)


def _midpoints(sampler: str, sigmas: np.ndarray, ramp: np.ndarray,
               alpha_bar_train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MIDPOINT_SOLVERS: float32 ``[n]`` each step's log-midpoint sigma, where its second model call is, and the
    model's t there (interpolated in the training log-sigmas, as diffusers' ``_sigma_to_t``).

    dpm2 and dpmpp_sde: the geometric mean ``exp((log s_i + log s_{i+1}) / 2)``, correctly rounded (torch's
    float32 log, lerp and exp land a few ulps away), 0 onto the final sigma 0. dpm2_a: the geometric mean
    of ``s_i`` and its ``sigma_down = s_{i+1}^2 / s_i``, which is ``s_{i+1}`` itself (KDPM2Ancestral's float32
    ``sigma_down`` cancels; it lands within a few ulps of it, or at NaN, see ``_solvers._ancestral_split``).
    DPMSolverSDE places its t from the float64 sigmas ``ramp`` (its ``_second_order_timesteps``).
    """
    s = sigmas.astype(np.float64)  # [n + 1]; the product of two float32 values is exact in float64
    mid = (s[1:] if sampler == "dpm2_a" else np.sqrt(s[:-1] * s[1:])).astype(_F32)  # 0 on the last step
    log_train = np.log(S.train_sigmas(alpha_bar_train))
    if sampler == "dpmpp_sde":
        lam = -np.log(ramp)  # [n] float64, DPMSolverSDE's t_fn
        t = S.sigma_to_t(np.append(np.exp(-(lam[:-1] + 0.5 * np.diff(lam))), 0.0), log_train)
    else:
        t = S.sigma_to_t(mid, log_train)
    return mid, t.astype(_F32)


def _lms_coefficients(sigmas: np.ndarray) -> np.ndarray:
    """lms: float32 ``[n, 4]``, step i's weight of the derivative of step ``i - k`` (k < the order
    ``min(i + 1, 4)``): the integral over ``[sigma_i, sigma_{i+1}]`` of that point's Lagrange basis
    polynomial through ``sigma_i .. sigma_{i-order+1}`` -- LMSDiscreteScheduler's
    ``get_lms_coefficient``, which integrates the same polynomial numerically. A basis polynomial
    is at most cubic, so two-point Gauss-Legendre is exact: here in float64, from the float32
    sigmas, every step at once."""
    n = len(sigmas) - 1
    s = sigmas.astype(np.float64)
    i = np.arange(n)
    order = np.minimum(i + 1, LMS_ORDER)  # [n]
    points = s[np.maximum(i[:, None] - np.arange(LMS_ORDER), 0)]  # [n, 4]: sigma_i, sigma_{i-1}, ...
    used = np.arange(LMS_ORDER) < order[:, None]  # [n, 4]
    half = (s[1:] - s[:-1]) / 2.0  # [n]
    nodes = ((s[1:] + s[:-1]) / 2.0)[:, None] + half[:, None] * np.array([-1.0, 1.0]) / np.sqrt(3.0)  # [n, 2]
    out = np.zeros((n, LMS_ORDER))
    for k in range(LMS_ORDER):
        basis = np.ones((n, 2))  # [n, 2]: this point's basis polynomial at the two nodes
        for m in range(LMS_ORDER):
            if m == k:
                continue
            both = used[:, k] & used[:, m]
            gap = np.where(both, points[:, k] - points[:, m], 1.0)
            basis *= np.where(both[:, None], (nodes - points[:, m, None]) / gap[:, None], 1.0)
        out[:, k] = np.where(used[:, k], half * basis.sum(axis=1), 0.0)  # weights 1, 1 on [-1, 1]
    return out.astype(_F32)


def _edm_rows(r: ResolvedEdmConfig, steps: int) -> _Rows:
    """EDM*Scheduler.set_timesteps: float32 sigmas from ``sigma_max`` down to ``sigma_min``, then the
    final sigma (0, or with ``final_sigmas_type="sigma_min"`` the ramp's last -- EDMEulerScheduler -- or
    the config's ``sigma_min`` -- EDMDPMSolverMultistepScheduler); the model's time is ``c_noise``.

    dpm++ orders: 1 at the first step (no history), then ``solver_order``; the last step is first
    order onto sigma 0, with ``euler_at_final``, or under 15 steps with ``lower_order_final``.
    """
    euler = r.sampler == "edm_euler"
    sig = S.edm_sigmas(r.sigma_schedule, r.sigma_min, r.sigma_max, r.rho, steps, float32_ramp=not euler)
    if not np.all(np.diff(sig) < 0):
        raise SchedulerConfigError(
            f"steps={steps} gives EDM sigmas that do not strictly decrease for sampler {r.sampler!r} "
            f"(sigma_min={r.sigma_min}, sigma_max={r.sigma_max}); use fewer steps")
    final = 0.0 if not r.final_sigma_min else sig[-1] if euler else r.sigma_min
    sigmas = np.append(sig, final).astype(_F32)
    n = steps
    order = np.ones(n, np.int32)
    if r.solver_order == 2:
        order[1:] = 2
        if r.euler_at_final or (r.lower_order_final and n < 15) or not r.final_sigma_min:
            order[-1] = 1
    if r.solver_type == "heun" and order[-1] == 2 and sigmas[-1] == sigmas[-2]:
        raise SchedulerConfigError(
            f"steps={steps} with final_sigmas_type='sigma_min' ends on a step that does not move (the ramp already "
            f"ends at sigma_min), where solver_type='heun''s second-order term is 0/0 (diffusers returns NaN); use "
            "euler_at_final=True or solver_type='midpoint'")
    init = _F32((r.sigma_max ** 2 + 1) ** 0.5)  # both classes' init_noise_sigma (a Python float)
    ones = np.ones(n, _F32)
    return S.edm_noise(sig), sigmas, ones, ones, order, init


def _unipc_corrector(r: ResolvedConfig, n: int) -> np.ndarray:
    """unipc: bool ``[n]``, whether step ``i`` corrects step ``i - 1``'s result with the model output
    at it (UniC): never on the first step, nor after a step listed in ``disable_corrector``."""
    idx = np.arange(n)
    return (idx > 0) & ~np.isin(idx - 1, np.asarray(r.disable_corrector, np.int64))


def _flow_rows(r: ResolvedFlowConfig, steps: int, mu: float | None, custom: "np.ndarray | list[float] | None") -> _Rows:
    """flow_euler / flow_heun: FlowMatch*DiscreteScheduler.set_timesteps, step for step.

    The state is ``x = (1 - sigma) * x0 + sigma * noise`` from sigma = 1 (pure noise, so
    ``init_noise_sigma`` is 1) to 0; the model sees ``t = sigma * num_train_timesteps``.
    """
    T = r.num_train_timesteps
    if r.use_dynamic_shifting:
        if mu is None:
            raise SchedulerConfigError(
                "mu is required with use_dynamic_shifting=True; compute it with flow_mu(config, image_seq_len)")
    if mu is not None:
        if isinstance(mu, bool) or not isinstance(mu, (int, float, np.integer, np.floating)) or not np.isfinite(mu):
            raise SchedulerConfigError(f"mu={mu!r} must be a finite number")
        mu = float(mu)
        if r.use_dynamic_shifting and r.time_shift_type == "linear" and not mu > 0:
            raise SchedulerConfigError(f"mu={mu} is not supported with time_shift_type='linear'; it must be > 0")
    if custom is None:
        sigma_max, sigma_min = S.flow_sigma_range(T, r.shift, r.use_dynamic_shifting)
        ts = np.linspace(sigma_max * T, sigma_min * T, steps)  # float64, as diffusers
        sig = ts / T
    else:
        arr = np.asarray(custom)
        if arr.ndim != 1 or len(arr) != steps or not np.issubdtype(arr.dtype, np.number):
            raise SchedulerConfigError(f"sigmas must be {steps} numbers (one per step), got shape {arr.shape}")
        sig = arr.astype(_F32)  # diffusers: np.array(sigmas).astype(np.float32)
        if not (np.all(np.isfinite(sig)) and np.all(sig > 0) and np.all(sig <= 1)):
            raise SchedulerConfigError("sigmas must lie in (0, 1]")
    if r.use_dynamic_shifting:
        sig = S.flow_time_shift(r.time_shift_type, mu, sig)
    else:
        sig = S.flow_shift(sig, r.shift)
    if r.shift_terminal:
        if not sig[-1] < 1:  # the stretch divides by 1 - (last sigma): diffusers returns NaN
            raise SchedulerConfigError(
                f"steps={steps} with shift_terminal={r.shift_terminal} ends the schedule at sigma 1, where the "
                "stretch is undefined (not strictly monotone); use more steps")
        sig = S.flow_stretch_to_terminal(sig, r.shift_terminal)
    if r.sigma_conversion:
        lo = r.sigma_min if r.sigma_min is not None else sig[-1].item()
        hi = r.sigma_max if r.sigma_max is not None else sig[0].item()
        if r.sigma_conversion == "karras":
            sig = S.karras_sigmas(lo, hi, steps)
        else:
            if not (lo > 0 and hi > 0):
                raise SchedulerConfigError(f"use_exponential_sigmas needs positive sigmas, got {hi}..{lo}")
            sig = S.exponential_sigmas(lo, hi, steps)
    sig32 = np.asarray(sig).astype(_F32)
    if r.invert_sigmas:  # Mochi: noise level runs up from 1 - sigma_0 to 1
        sig32 = (_F32(1.0) - sig32).astype(_F32)
        final = _F32(1.0)
    else:
        final = _F32(0.0)
    timesteps = (sig32 * _F32(T)).astype(_F32)
    sigmas = np.append(sig32, final).astype(_F32)
    steps_ok = np.diff(sigmas) > 0 if r.invert_sigmas else np.diff(sigmas) < 0
    if not (np.all(np.isfinite(sigmas)) and np.all(steps_ok)):
        raise SchedulerConfigError(
            f"steps={steps} gives flow sigmas that are not strictly monotone for sampler {r.sampler!r} "
            "(check sigmas, shift_terminal, sigma_min/sigma_max); every step must move"
        )
    n = len(timesteps)
    ones = np.ones(n, _F32)
    return timesteps, sigmas, ones, ones, np.ones(n, np.int32), _F32(1.0)


# --- validity ---------------------------------------------------------------------------------


def _check_zero_snr(r: ResolvedConfig, timesteps: np.ndarray, alpha_bar: np.ndarray) -> None:
    """A noise prediction at zero SNR (alphas_cumprod 0: the last training timestep once the betas are
    rescaled, for the classes that do not clamp it) says nothing about x0; diffusers returns NaN there."""
    if r.prediction_type == "epsilon" and r.sampler not in _SIGMA_SAMPLERS and np.any(alpha_bar == 0):
        t = int(timesteps[int(np.argmax(alpha_bar == 0))])
        raise SchedulerConfigError(
            f"prediction_type='epsilon' with rescale_betas_zero_snr=True reaches zero SNR at timestep {t}, where "
            f"sampler {r.sampler!r} cannot recover x0 from the noise (diffusers returns NaN); zero-SNR models "
            "predict v (prediction_type='v_prediction'), or use timestep_spacing='leading'")


def _check_range(r: ResolvedConfig, steps: int, ts: np.ndarray) -> None:
    """Refuse spacings that put a timestep outside training range (diffusers would crash or wrap).

    E.g. "trailing" spacing with 61 of 1000 steps yields a 62nd timestep, -1, in diffusers.
    """
    T = r.num_train_timesteps
    bad = ts[(ts < 0) | (ts > T - 1)]
    if len(bad):
        raise SchedulerConfigError(
            f"steps={steps} with timestep_spacing={r.timestep_spacing!r} and steps_offset={r.steps_offset} "
            f"gives timestep {bad[0]:g}, outside [0, {T - 1}]; choose another step count"
        )


def _check_schedule(r: ResolvedConfig, steps: int, ts: np.ndarray, sigmas: np.ndarray | None) -> None:
    """Steps must move: repeated sigmas (or timesteps) make zero-length steps (dpm++ divides by them).
    Except deis's Karras landing: its last sigma repeats the ramp's last, so diffusers' last step does
    not move; its update is finite there (both ends of the integral are the same point), so we do the same."""
    if sigmas is not None and r.sampler == "deis" and r.use_karras_sigmas:
        sigmas = sigmas[:-1]
    if sigmas is not None:
        ok = bool(np.all(np.diff(sigmas) < 0))
    else:
        ok = bool(np.all(np.diff(ts) < 0))
    if not ok:
        raise SchedulerConfigError(
            f"steps={steps} with timestep_spacing={r.timestep_spacing!r} gives noise levels that do not "
            f"strictly decrease for sampler {r.sampler!r} (check sigma_min/sigma_max); use fewer steps"
        )


assert set(_SOLVER_OF_SAMPLER) == set(SAMPLERS)
