"""Host side: each sampler family's schedule, diffusers' ``set_timesteps`` step for step, as the
rows ``make_plan`` pads into a ``Plan``; and the checks that refuse a schedule whose steps do not move.

Every ``*_rows`` function returns (timesteps f32 [n], sigmas f32 [n+1] or [0], alpha_bar f32 [n],
alpha_bar_prev f32 [n], order int32 [n], init_noise_sigma f32); the few extra rows a solver reads
(tcd's ``alpha_bar_mid``, unipc's corrector, lms's coefficients, the midpoint solvers' second call)
have their own functions. The tables come from ``_schedules`` through its module (``S.betas``, ...),
so the parity tests can put torch's own in their place.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from preheat.errors import SchedulerConfigError
from preheat.samplers import _schedules as S
from preheat.samplers._config import ResolvedConfig, ResolvedEdmConfig, ResolvedFlowConfig

_F32 = np.float32

# Samplers whose schedule is a sigma ramp (the sigma-space classes: Euler, DPM-Solver, UniPC, ...).
SIGMA_SAMPLERS: tuple[str, ...] = ("euler", "euler_a", "heun", "dpmpp_2m", "dpmpp_2m_karras", "dpmpp_2m_sde",
                                   "dpmpp_2m_sde_karras", "unipc", "deis", "lms", "dpm2", "dpm2_a", "dpmpp_sde",
                                   "dpmpp_2s", "dpmpp_2s_karras")
# lms's order: the derivatives it weighs (LMSDiscreteScheduler.step's default, which pipelines keep).
LMS_ORDER = 4

Rows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.float32]


def train_alphas_cumprod(r: ResolvedConfig) -> np.ndarray:
    """alphas_cumprod of the training schedule, float32 ``[T]``: from the betas, rescaled to zero terminal
    SNR when the config says so; then the sigma-space classes (Euler, DPM-Solver, UniPC) put its last
    entry at 2**-24 instead of 0, so that their largest sigma (~4096) is finite, as diffusers does."""
    beta = S.betas(r.beta_schedule, r.beta_start, r.beta_end, r.num_train_timesteps)
    if not r.rescale_betas_zero_snr:
        return S.alphas_cumprod(beta)
    alpha_bar = S.alphas_cumprod(S.rescale_zero_terminal_snr(beta))
    if r.sampler in SIGMA_SAMPLERS:
        alpha_bar[-1] = _F32(2.0 ** -24)
    return alpha_bar


def discrete_rows(r: ResolvedConfig, steps: int, alpha_bar_train: np.ndarray) -> Rows:
    """ddpm/ddim: integer timesteps; the alpha-bar each step moves to.

    diffusers' DDPM moves to the *next listed* timestep; DDIM moves to ``t - T // steps``
    even when the spacing is not ``T // steps`` apart (linspace/trailing) -- both kept.
    """
    T = r.num_train_timesteps
    ts = S.spaced_timesteps(r.timestep_spacing, T, steps, r.steps_offset)
    if r.timestep_spacing == "linspace":
        ts = ts.round()
    ts_int = ts.astype(np.int64)
    check_range(r, steps, ts_int)
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


def lcm_rows(r: ResolvedConfig, steps: int, alpha_bar_train: np.ndarray,
              custom: "np.ndarray | Sequence[int] | None" = None) -> Rows:
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


def tcd_mid(timesteps: np.ndarray, eta: float, alpha_bar_train: np.ndarray) -> np.ndarray:
    """tcd: alphas_cumprod at each step's intermediate ``s = floor((1 - eta) * t_next)`` (``t_next``
    = 0 after the last step), float32 ``[n]``. TCDScheduler computes ``s`` in torch float32 (the
    Python float ``1 - eta`` times an int64 timestep), so we round the same way before flooring."""
    t_next = np.append(timesteps[1:], 0).astype(_F32)  # [n]
    s = np.floor(_F32(1.0 - eta) * t_next).astype(np.int64)  # float32 product, as torch
    return alpha_bar_train[s].astype(_F32)


def pndm_rows(r: ResolvedConfig, steps: int, alpha_bar_train: np.ndarray) -> tuple[Rows, np.ndarray]:
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
    check_range(r, steps, grid_int)
    check_schedule(r, steps, grid_int.astype(_F32), None)
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


def sigma_rows(r: ResolvedConfig, steps: int, alpha_bar_train: np.ndarray) -> tuple[Rows, np.ndarray]:
    """euler, euler_a, heun, lms, dpm2, dpm2_a, dpmpp_sde: float32 timesteps, sigmas interpolated linearly in t;
    and those sigmas in float64 ``[n]`` (DPMSolverSDE places its midpoint timesteps from them)."""
    T = r.num_train_timesteps
    ts = S.spaced_timesteps(r.timestep_spacing, T, steps, r.steps_offset)
    ts32 = ts.astype(_F32)  # diffusers casts before interpolating...
    if not r.use_karras_sigmas:  # with Karras they only pick the (clamped) end sigmas
        check_range(r, steps, ts32)
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


def dpm_rows(r: ResolvedConfig, steps: int, alpha_bar_train: np.ndarray) -> Rows:
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
        check_range(r, steps, ts_int)
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


def midpoint_rows(sampler: str, sigmas: np.ndarray, ramp: np.ndarray,
               alpha_bar_train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MIDPOINT_SOLVERS: float32 ``[n]`` each step's log-midpoint sigma, where its second model call is, and the
    model's t there (interpolated in the training log-sigmas, as diffusers' ``_sigma_to_t``).

    dpm2 and dpmpp_sde: the geometric mean ``exp((log s_i + log s_{i+1}) / 2)``, correctly rounded (torch's
    float32 log, lerp and exp land a few ulps away), 0 onto the final sigma 0. dpm2_a: the geometric mean
    of ``s_i`` and its ``sigma_down = s_{i+1}^2 / s_i``, which is ``s_{i+1}`` itself (KDPM2Ancestral's float32
    ``sigma_down`` cancels; it lands within a few ulps of it, or at NaN, see ``_core.ancestral_split``).
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


def lms_coefficients(sigmas: np.ndarray) -> np.ndarray:
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


def edm_rows(r: ResolvedEdmConfig, steps: int) -> Rows:
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


def unipc_corrector(r: ResolvedConfig, n: int) -> np.ndarray:
    """unipc: bool ``[n]``, whether step ``i`` corrects step ``i - 1``'s result with the model output
    at it (UniC): never on the first step, nor after a step listed in ``disable_corrector``."""
    idx = np.arange(n)
    return (idx > 0) & ~np.isin(idx - 1, np.asarray(r.disable_corrector, np.int64))


def flow_rows(r: ResolvedFlowConfig, steps: int, mu: float | None, custom: "np.ndarray | list[float] | None") -> Rows:
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


def check_zero_snr(r: ResolvedConfig, timesteps: np.ndarray, alpha_bar: np.ndarray) -> None:
    """A noise prediction at zero SNR (alphas_cumprod 0: the last training timestep once the betas are
    rescaled, for the classes that do not clamp it) says nothing about x0; diffusers returns NaN there."""
    if r.prediction_type == "epsilon" and r.sampler not in SIGMA_SAMPLERS and np.any(alpha_bar == 0):
        t = int(timesteps[int(np.argmax(alpha_bar == 0))])
        raise SchedulerConfigError(
            f"prediction_type='epsilon' with rescale_betas_zero_snr=True reaches zero SNR at timestep {t}, where "
            f"sampler {r.sampler!r} cannot recover x0 from the noise (diffusers returns NaN); zero-SNR models "
            "predict v (prediction_type='v_prediction'), or use timestep_spacing='leading'")


def check_range(r: ResolvedConfig, steps: int, ts: np.ndarray) -> None:
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


def check_schedule(r: ResolvedConfig, steps: int, ts: np.ndarray, sigmas: np.ndarray | None) -> None:
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
