"""Device side: pure, traceable solver steps in float32 jax.numpy.

Every solver sees the model only as ``model(x_in, t) -> raw output`` and reads its schedule
from the ``Plan`` at a (possibly traced) step index ``i``; nothing is kept between calls but
the explicit ``SamplerState``. Shared pieces are written once:

* :func:`_denoise` -- input scaling, the model call, prediction-type conversion, clipping;
* :func:`_euler_move` -- the first-order move along ``(x - x0) / sigma`` (euler_a, dpm2(_a), dpmpp_sde);
* :func:`_ancestral_split` -- an ancestral move's ``(sigma_down, sigma_up)`` (euler_a, dpm2_a, dpmpp_sde);
* :func:`_derivative` -- ``dx/dsigma`` at a step: from the x0 estimate, or the model's own
  velocity for flow matching (euler and heun serve both).

Notation: the state is ``x = alpha * x0 + sigma * eps``. ddpm/ddim/dpm++ keep the
variance-preserving latent (``alpha**2 + sigma**2 = 1``); euler/euler_a/heun/lms/dpm2(_a)/dpmpp_sde
(:data:`VE_SOLVERS`) keep the variance-exploding one (``alpha = 1``) and feed the model ``x / sqrt(sigma**2 + 1)``.
Flow matching (``prediction_type == "flow"``: flow_euler, flow_heun) keeps
``x = (1 - sigma) * x0 + sigma * eps``, feeds the model ``x`` itself, and the model returns
the velocity ``dx/dsigma = eps - x0``. EDM samplers (``spec.sigma_data > 0``: edm_euler and
edm_dpmpp_2m(_sde), run by the euler and dpm++ solvers) keep the variance-exploding state and feed
the model ``c_in x`` at ``t = c_noise``; its output gives ``x0 = c_skip x + c_out F``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from preheat.errors import InvalidArgumentError
from preheat.progress import report_step
from preheat.samplers._plan import LMS_ORDER, Plan, SolverSpec

__all__ = ["SamplerState", "Start", "Model", "NoiseFn", "init", "step", "run", "noised", "BLEND_SOLVERS",
           "VE_SOLVERS"]

Model = Callable[[jax.Array, jax.Array], jax.Array]
"""``model(x_in, t)``: raw network output (epsilon / v / x0) for input ``x_in`` at float32 scalar ``t``."""

NoiseFn = Callable[[jax.Array, int], jax.Array]
"""``noise_fn(i, k)``: standard-normal noise shaped like the sample, draw ``k`` of step ``i``."""


class SamplerState(NamedTuple):
    """Everything carried from one step to the next (a pytree; the ``fori_loop`` carry)."""

    x: jax.Array  # [*S] float32: the current sample
    x0_prev: jax.Array | None = None  # [*S] float32: previous x0 prediction (dpm++ only)
    x0_history: jax.Array | None = None  # [K, *S] float32: unipc: x0 of steps i-1 .. i-K (K = solver_order)
    x_last: jax.Array | None = None  # [*S] float32: unipc: the sample step i - 1 started from (UniC's)
    count: jax.Array | None = None  # int32 []: pndm: calls since init / start (diffusers' counter)
    x_start: jax.Array | None = None  # [*S] float32: pndm: the sample entering call 0 (call 1 restarts there)
    outputs: jax.Array | None = None  # [3, *S] float32: pndm: earlier raw model outputs, newest first
    eps_history: jax.Array | None = None  # [K, *S] float32: deis: eps of steps i-1 .. i-K (K = solver_order)
    derivatives: jax.Array | None = None  # [3, *S] float32: lms: dx/dsigma of steps i-1 .. i-3
    x_pair: jax.Array | None = None  # [*S] float32: dpmpp_2s: the sample its current singlestep pair started from


class Start(NamedTuple):
    """Where an image-conditioned call begins (img2img, inpainting; a pytree of data).

    diffusers' img2img / inpaint pipelines cut the schedule at ``t_start`` (``get_timesteps``) and
    put the encoded image at that step's noise level (``add_noise``; flow: ``scale_noise``); step
    ``index`` of the same padded ``Plan`` is that start here, so a strength never recompiles.
    """

    index: jax.Array  # int32 []: the first step run (the pipeline's t_start)
    x0: jax.Array  # [*S] float32: the clean latents (the encoded image) the noise goes onto
    pure_noise: jax.Array  # bool []: begin from the noise alone, scaled by init_noise_sigma
    #   (diffusers' inpainting at strength 1 does; its img2img noises the image even then)
    keep: jax.Array | None = None  # [*S] (or broadcastable) float32, 1 = repaint: after every step the
    #   rest is put back as x0 noised to the next level (mask blending on a base model's 4 channels)


# Mask blending needs one blend per scheduler call; Heun's and DPM2's two calls per step are one step here.
BLEND_SOLVERS: tuple[str, ...] = ("ddpm", "ddim", "euler", "euler_a", "dpmpp_2m", "lcm", "tcd", "unipc",
                                  "dpmpp_2m_sde", "pndm", "deis", "lms", "dpmpp_2s")
# dpm++ solvers: they carry the previous x0 and start (again) at first order.
_DPM_SOLVERS: tuple[str, ...] = ("dpmpp_2m", "dpmpp_2m_sde", "dpmpp_2s")
# Solvers on the variance-exploding state ``x = x0 + sigma eps`` (EDM samplers too, by spec.sigma_data).
VE_SOLVERS: tuple[str, ...] = ("euler", "euler_a", "heun", "lms", "dpm2", "dpm2_a", "dpmpp_sde")


def init(spec: SolverSpec, plan: Plan, noise: jax.Array) -> SamplerState:
    """Scale standard-normal ``noise`` into the first sample (diffusers' ``init_noise_sigma``)."""
    x = jnp.asarray(noise, jnp.float32) * jnp.asarray(plan.init_noise_sigma, jnp.float32)
    history = jnp.zeros_like(x) if spec.solver in _DPM_SOLVERS else None
    if spec.solver == "unipc":
        return SamplerState(x=x, x0_history=jnp.zeros((spec.solver_order, *x.shape), x.dtype), x_last=x)
    if spec.solver == "pndm":
        return SamplerState(x=x, count=jnp.int32(0), x_start=jnp.zeros_like(x),
                            outputs=jnp.zeros((3, *x.shape), x.dtype))
    if spec.solver == "deis":
        return SamplerState(x=x, eps_history=jnp.zeros((spec.solver_order, *x.shape), x.dtype))
    if spec.solver == "lms":  # none yet: the first steps' missing terms weigh zeros (diffusers drops them)
        return SamplerState(x=x, derivatives=jnp.zeros((LMS_ORDER - 1, *x.shape), x.dtype))
    if spec.solver == "dpmpp_2s":
        return SamplerState(x=x, x0_prev=history, x_pair=x)
    return SamplerState(x=x, x0_prev=history)


def step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array | int,
         noise_fn: NoiseFn) -> SamplerState:
    """Advance ``state`` by step ``i`` of ``plan`` (``0 <= i < plan.n_steps``)."""
    try:
        solver = _STEP_OF_SOLVER[spec.solver]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown solver {spec.solver!r} in SolverSpec; supported: {', '.join(_STEP_OF_SOLVER)}"
        ) from None
    return solver(spec, model, plan, state, jnp.asarray(i, jnp.int32), noise_fn)


def run(spec: SolverSpec, model: Model, plan: Plan, noise: jax.Array, noise_fn: NoiseFn,
        start: Start | None = None, progress: bool = False, restart: jax.Array | None = None) -> jax.Array:
    """The whole denoising loop: ``init`` then ``plan.n_steps`` steps; returns the final sample.

    The trip count is traced, so one compiled program serves every step count. With ``start``
    the loop runs steps ``start.index .. n_steps - 1`` from ``start.x0`` noised with ``noise``
    to step ``start.index``'s level (the index is traced too: one program for every strength).
    ``restart`` (int32 [], traced; None: none): from that step on the solver forgets what it
    carried and warms up again, the sample kept as it is -- what a second diffusers pipeline
    continuing the first's latents from ``denoising_start`` does with its fresh scheduler (SDXL's
    ensemble of experts); a restart at or before the first step run changes nothing.
    ``progress`` (static): report each finished step to the host, for the call
    ``plan.progress_id`` (``preheat.progress``), counting the steps this call runs (k of
    ``n_steps - start.index``, as diffusers' progress bar counts an img2img call).
    """
    first = jnp.int32(0)
    n_steps = jnp.asarray(plan.n_steps, jnp.int32)
    if start is None:
        state = init(spec, plan, noise)
    else:
        first = jnp.asarray(start.index, jnp.int32)
        state = init(spec, plan, noise)
        x = jnp.where(start.pure_noise, state.x, noised(spec, plan, start.x0, noise, first))
        state = state._replace(x=x)

    def segment(plan: Plan, begin: jax.Array, end: jax.Array, state: SamplerState) -> SamplerState:
        def body(i: jax.Array, s: SamplerState) -> SamplerState:
            s = step(spec, model, plan, s, i, noise_fn)
            if start is not None and start.keep is not None:
                # diffusers' inpaint loop: the kept region is x0 at the next step's level (x0 itself at the end)
                last = i == n_steps - 1
                kept = jnp.where(last, start.x0, noised(spec, plan, start.x0, noise, i + 1))
                s = s._replace(x=(1.0 - start.keep) * kept + start.keep * s.x)
            if progress:
                report_step(jnp.asarray(plan.progress_id, jnp.int32), i + 1 - first, n_steps - first, s.x)
            return s

        return jax.lax.fori_loop(begin, end, body, state)

    begun = plan if start is None else fresh_from(spec, plan, first)  # from noise: the plan is the fresh one
    if restart is None:
        return segment(begun, first, n_steps, state).x
    turn = jnp.clip(jnp.asarray(restart, jnp.int32), first, n_steps)
    state = segment(begun, first, turn, state)
    state = init(spec, plan, state.x)._replace(x=state.x)  # what a fresh scheduler carries: nothing yet
    return segment(fresh_from(spec, plan, turn), turn, n_steps, state).x


def fresh_from(spec: SolverSpec, plan: Plan, first: jax.Array) -> Plan:
    """``plan`` as a fresh diffusers scheduler runs it from step ``first`` on (``set_begin_index``):
    multistep solvers have no history there, so their order warms up again from that step."""
    if spec.solver in _DPM_SOLVERS:  # no history at the first step run: first order, as diffusers
        plan = plan._replace(order=jnp.asarray(plan.order).at[first].set(1))
    if spec.solver in ("unipc", "deis"):  # the order warms up from the first step run
        warm = jnp.arange(jnp.shape(plan.order)[0], dtype=jnp.int32) - first + 1
        plan = plan._replace(order=jnp.minimum(jnp.asarray(plan.order), warm))
    if spec.solver == "unipc":  # nothing to correct at the first step run
        plan = plan._replace(corrector=jnp.asarray(plan.corrector).at[first].set(False))
    return plan


def noised(spec: SolverSpec, plan: Plan, x0: jax.Array, noise: jax.Array, i: jax.Array | int) -> jax.Array:
    """``x0`` at step ``i``'s noise level in the solver's own state, as the diffusers scheduler's
    ``add_noise`` (flow: ``scale_noise``) puts it: VE ``x0 + sigma eps`` (EDM samplers too); dpm++ ``alpha(sigma) x0 +
    sigma_vp eps`` from its sigmas (unipc and deis alike); ddpm/ddim/lcm/tcd/pndm ``sqrt(ab) x0 + sqrt(1 - ab) eps`` at
    ``t_i``."""
    i = jnp.asarray(i, jnp.int32)
    x0, noise = jnp.asarray(x0, jnp.float32), jnp.asarray(noise, jnp.float32)
    if spec.prediction_type == "flow":
        sigma = _at(plan.sigmas, i)
        return sigma * noise + (1.0 - sigma) * x0
    if spec.solver in VE_SOLVERS or spec.sigma_data:  # EDM: variance exploding
        return x0 + noise * _at(plan.sigmas, i)
    if spec.solver in (*_DPM_SOLVERS, "unipc", "deis"):
        alpha, sigma = _vp(_at(plan.sigmas, i))
        return alpha * x0 + sigma * noise
    ab = _at(plan.alpha_bar, i)
    return jnp.sqrt(ab) * x0 + jnp.sqrt(1.0 - ab) * noise


# --- shared pieces ----------------------------------------------------------------------------


def _at(table: jax.Array, i: jax.Array) -> jax.Array:
    """``table[i]`` for a numpy or jax table and a possibly traced index."""
    return jnp.asarray(table)[i]


def _denoise(spec: SolverSpec, model: Model, x: jax.Array, t: jax.Array, c_in: jax.Array | float,
             alpha: jax.Array | float, sigma: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Call the model on the scaled input and convert its output to ``(x0, eps)``.

    ``x = alpha * x0 + sigma * eps`` and the model sees ``z = c_in * x``, a
    variance-preserving latent ``z = a * x0 + s * eps`` with ``(a, s) = c_in * (alpha, sigma)``.
    ``eps`` comes from the *unclipped* x0 (as diffusers' DDIM without
    ``use_clipped_model_output``); only x0 is clipped.
    """
    z = x * c_in  # [*S] model input (scale_model_input)
    out = model(z, t)
    if out.shape != x.shape:
        raise InvalidArgumentError(f"model output shape {out.shape} != sample shape {x.shape}")
    out = out.astype(x.dtype)
    a, s = alpha * c_in, sigma * c_in  # VP coefficients of z
    if spec.prediction_type == "epsilon":
        x0 = (x - sigma * out) / alpha
        eps = out
    elif spec.prediction_type == "v_prediction":  # v = a * eps - s * x0
        x0 = a * z - s * out
        eps = a * out + s * z
    elif spec.prediction_type == "sample":
        x0 = out
        eps = (z - a * x0) / s
    else:
        raise InvalidArgumentError(
            f"prediction_type={spec.prediction_type!r} in SolverSpec; supported: epsilon, v_prediction, sample"
        )
    if spec.clip_sample:
        x0 = jnp.clip(x0, -spec.clip_sample_range, spec.clip_sample_range)
    return x0, eps


def _edm_denoise(spec: SolverSpec, model: Model, x: jax.Array, t: jax.Array, sigma: jax.Array) -> jax.Array:
    """x0 under EDM's preconditioning (Karras et al. 2022, Table 1), as the EDM*Schedulers compute it:
    the model sees ``c_in x`` at ``t = c_noise`` and returns ``F``; ``x0 = c_skip x + c_out F``
    (``c_out`` negated for a v-prediction network)."""
    sd = spec.sigma_data
    total = sigma * sigma + sd * sd  # sigma^2 + sigma_data^2
    out = model(x * (1.0 / jnp.sqrt(total)), t)  # c_in x
    if out.shape != x.shape:
        raise InvalidArgumentError(f"model output shape {out.shape} != sample shape {x.shape}")
    c_skip = (sd * sd) / total
    c_out = sigma * sd / jnp.sqrt(total)
    if spec.prediction_type == "v_prediction":
        c_out = -c_out
    return c_skip * x + c_out * out.astype(x.dtype)


def _ve_denoise(spec: SolverSpec, model: Model, x: jax.Array, t: jax.Array, sigma: jax.Array) -> jax.Array:
    """x0 for a variance-exploding state (``alpha = 1``): the model sees ``x / sqrt(sigma^2 + 1)``
    (EDM samplers: ``c_in x``, see :func:`_edm_denoise`)."""
    if spec.sigma_data:
        return _edm_denoise(spec, model, x, t, sigma)
    c_in = 1.0 / jnp.sqrt(sigma * sigma + 1.0)
    x0, _ = _denoise(spec, model, x, t, c_in, 1.0, sigma)
    return x0


def _derivative(spec: SolverSpec, model: Model, x: jax.Array, t: jax.Array, sigma: jax.Array) -> jax.Array:
    """``dx/dsigma`` at noise level ``sigma``: the model's velocity for flow matching, else
    ``(x - x0) / sigma`` of the variance-exploding state."""
    if spec.prediction_type == "flow":
        v = model(x, t)  # the model sees the sample unscaled
        if v.shape != x.shape:
            raise InvalidArgumentError(f"model output shape {v.shape} != sample shape {x.shape}")
        return v.astype(x.dtype)
    x0 = _ve_denoise(spec, model, x, t, sigma)
    return (x - x0) / sigma  # [*S]


def _euler_move(x: jax.Array, x0: jax.Array, sigma: jax.Array, sigma_to: jax.Array) -> jax.Array:
    """One Euler step of ``dx/dsigma = (x - x0) / sigma`` from ``sigma`` to ``sigma_to``, written as
    DPM-Solver-1's ``x0 + (sigma_to / sigma) (x - x0)``: the same value, without ``x + d (sigma_to - sigma)``'s
    cancellation when ``sigma_to << sigma`` (from sigma ~2e4 the sample is ~1e4 and the result ~1: that form
    loses ~1e-3 to an ulp of the sample)."""
    return x0 + (sigma_to / sigma) * (x - x0)  # [*S]


def _ancestral_split(sigma: jax.Array, sigma_to: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sigma_down, sigma_up)`` of an ancestral move from ``sigma`` to ``sigma_to`` (eta 1, k-diffusion's
    ``get_ancestral_step``): a deterministic move to ``sigma_down = sigma_to^2 / sigma``, then fresh noise of
    std ``sigma_up = sigma_to sqrt(sigma^2 - sigma_to^2) / sigma``; 0 and 0 onto ``sigma_to = 0``.

    Written without cancellation, so both are within a few ulps of the exact values. diffusers' float32
    ``sqrt(sigma_to^2 - sigma_up^2)`` cancels: its sigma_down is rounding noise, or 0 (KDPM2Ancestral: NaN),
    once ``sigma / sigma_to`` passes 4096 (a cosine schedule's first step from ~2e4), and its sigma_up
    carries ``sigma^2 / (sigma^2 - sigma_to^2)`` ulps on fine steps. (Its float64 run agrees with ours.)
    """
    sigma_down = sigma_to * (sigma_to / sigma)
    sigma_up = sigma_to * jnp.sqrt((sigma - sigma_to) * (sigma + sigma_to)) / sigma  # (s - t) is exact near s
    return sigma_down, sigma_up


def _ve_coefficients(sigma: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(alpha, sigma) of the variance-exploding state at noise level ``sigma``: ``(1, sigma)``."""
    return jnp.ones_like(sigma), sigma


def _vp(sigma: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(alpha, sigma_vp) of the variance-preserving latent at VE noise level ``sigma``."""
    alpha = 1.0 / jnp.sqrt(sigma * sigma + 1.0)
    return alpha, sigma * alpha


# --- solvers ------------------------------------------------------------------------------------


def _ddpm_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
               noise_fn: NoiseFn) -> SamplerState:
    """Ancestral DDPM posterior step q(x_prev | x_t, x0) to the next listed timestep."""
    x, t = state.x, _at(plan.timesteps, i)
    ab, ab_prev = _at(plan.alpha_bar, i), _at(plan.alpha_bar_prev, i)
    x0, _ = _denoise(spec, model, x, t, 1.0, jnp.sqrt(ab), jnp.sqrt(1.0 - ab))
    beta_prod, beta_prod_prev = 1.0 - ab, 1.0 - ab_prev
    alpha_step = ab / ab_prev  # alpha of this (possibly multi-timestep) jump
    beta_step = 1.0 - alpha_step
    mean = (jnp.sqrt(ab_prev) * beta_step) / beta_prod * x0 + jnp.sqrt(alpha_step) * beta_prod_prev / beta_prod * x
    var = jnp.maximum((1.0 - ab_prev) / (1.0 - ab) * beta_step, 1e-20)  # posterior variance
    if spec.variance_type == "fixed_large":
        std = jnp.sqrt(beta_step)
    elif spec.variance_type == "fixed_small_log":
        std = jnp.exp(0.5 * jnp.log(var))
    else:  # fixed_small
        std = jnp.sqrt(var)
    noise = noise_fn(i, 0)
    x_new = jnp.where(t > 0, mean + std * noise, mean)  # diffusers adds no noise at t == 0
    return state._replace(x=x_new)


def _ddim_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
               noise_fn: NoiseFn) -> SamplerState:
    """DDIM (Song et al. 2021, eq. 12); ``eta`` interpolates towards DDPM's stochasticity."""
    x, t = state.x, _at(plan.timesteps, i)
    ab, ab_prev = _at(plan.alpha_bar, i), _at(plan.alpha_bar_prev, i)
    x0, eps = _denoise(spec, model, x, t, 1.0, jnp.sqrt(ab), jnp.sqrt(1.0 - ab))
    var = (1.0 - ab_prev) / (1.0 - ab) * (1.0 - ab / ab_prev)
    std = jnp.asarray(plan.eta, jnp.float32) * jnp.sqrt(var)
    direction = jnp.sqrt(1.0 - ab_prev - std * std) * eps
    x_new = jnp.sqrt(ab_prev) * x0 + direction
    x_new = x_new + std * noise_fn(i, 0)  # std == 0 when eta == 0: adds exactly 0
    return state._replace(x=x_new)


def _euler_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
                noise_fn: NoiseFn) -> SamplerState:
    """Euler on the probability-flow ODE in sigma (Karras et al. 2022, Alg. 1 without churn);
    for flow matching, FlowMatchEulerDiscreteScheduler's ``x + (sigma_next - sigma) * v``."""
    sigma, sigma_next = _at(plan.sigmas, i), _at(plan.sigmas, i + 1)
    d = _derivative(spec, model, state.x, _at(plan.timesteps, i), sigma)
    return state._replace(x=state.x + d * (sigma_next - sigma))


def _euler_a_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
                  noise_fn: NoiseFn) -> SamplerState:
    """Euler to ``sigma_down`` then fresh noise of std ``sigma_up`` (sigma_down^2 + sigma_up^2 = sigma_next^2)."""
    sigma, sigma_next = _at(plan.sigmas, i), _at(plan.sigmas, i + 1)
    x0 = _ve_denoise(spec, model, state.x, _at(plan.timesteps, i), sigma)
    sigma_down, sigma_up = _ancestral_split(sigma, sigma_next)
    x_new = _euler_move(state.x, x0, sigma, sigma_down)
    x_new = x_new + noise_fn(i, 0) * sigma_up
    return state._replace(x=x_new)


def _heun_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
               noise_fn: NoiseFn) -> SamplerState:
    """Heun's 2nd-order method (Karras et al. 2022, Alg. 1); plain Euler onto sigma = 0.
    The same for flow matching (FlowMatchHeunDiscreteScheduler), with the model's velocity."""
    x = state.x
    sigma, sigma_next = _at(plan.sigmas, i), _at(plan.sigmas, i + 1)
    d = _derivative(spec, model, x, _at(plan.timesteps, i), sigma)
    x_euler = x + d * (sigma_next - sigma)

    def correct(_: None) -> jax.Array:
        # the model at the Euler point; its timestep is the next step's
        d_next = _derivative(spec, model, x_euler, _at(plan.timesteps, i + 1), sigma_next)
        return x + (d + d_next) / 2 * (sigma_next - sigma)

    x_new = jax.lax.cond(sigma_next > 0, correct, lambda _: x_euler, None)
    return state._replace(x=x_new)


def _dpm2_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
               noise_fn: NoiseFn) -> SamplerState:
    """DPM-Solver-2 (Lu et al. 2022; k-diffusion's ``sample_dpm_2``, KDPM2DiscreteScheduler, "DPM2"): Euler to the
    log-midpoint sigma, the model there, and the whole step along that midpoint's derivative; on the
    last step (midpoint 0) the first call's Euler move onto sigma 0 is the result (one call).

    dpm2_a, its ancestral form (``sample_dpm_2_ancestral``, KDPM2AncestralDiscreteScheduler, "DPM2 a"), aims the
    step at ``sigma_down`` and adds fresh noise of std ``sigma_up``; its midpoint, the geometric mean of
    ``sigma_i`` and ``sigma_down = sigma_{i+1}^2 / sigma_i``, is ``sigma_{i+1}`` (the Plan's ``mid_sigmas``).
    """
    x = state.x
    sigma, sigma_next = _at(plan.sigmas, i), _at(plan.sigmas, i + 1)
    sigma_mid = _at(plan.mid_sigmas, i)
    ancestral = spec.solver == "dpm2_a"
    target, sigma_up = _ancestral_split(sigma, sigma_next) if ancestral else (sigma_next, None)
    x0 = _ve_denoise(spec, model, x, _at(plan.timesteps, i), sigma)
    x_mid = _euler_move(x, x0, sigma, sigma_mid)  # [*S]

    def second(_: None) -> jax.Array:
        d_mid = _derivative(spec, model, x_mid, _at(plan.mid_timesteps, i), sigma_mid)
        return x + d_mid * (target - sigma)

    x_new = jax.lax.cond(sigma_mid > 0, second, lambda _: x_mid, None)
    if ancestral:  # sigma_up is 0 on the last step
        x_new = x_new + noise_fn(i, 0) * sigma_up
    return state._replace(x=x_new)


def _dpmpp_sde_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
                    noise_fn: NoiseFn) -> SamplerState:
    """DPM-Solver++ SDE (k-diffusion's ``sample_dpmpp_sde`` with r = 1/2, DPMSolverSDEScheduler, "DPM++ SDE"):
    an ancestral DPM-Solver-1 move (Euler to ``sigma_down``, noise of std ``sigma_up``) to the log-midpoint,
    the model there, and a second such move over the whole step from the step's start with that x0.

    The two moves' noises are the normalised increments of one Brownian path ``W(sigma)`` over
    ``[sigma_mid, sigma]`` and ``[sigma_next, sigma]`` (diffusers draws them from a torchsde BrownianTree);
    the second interval holds the first, so the second is ``c n_0 + sqrt(1 - c^2) n_1`` with
    ``c^2 = (sigma - sigma_mid) / (sigma - sigma_next)``: the same law, from the step's two draws. The last step
    (onto sigma 0) is one call, Euler's, without noise.
    """
    x = state.x
    sigma, sigma_next = _at(plan.sigmas, i), _at(plan.sigmas, i + 1)
    sigma_mid = _at(plan.mid_sigmas, i)
    x0 = _ve_denoise(spec, model, x, _at(plan.timesteps, i), sigma)

    def stochastic(_: None) -> jax.Array:
        first = noise_fn(i, 0)  # [*S] the increment over [sigma_mid, sigma], normalised
        down, up = _ancestral_split(sigma, sigma_mid)
        x_mid = _euler_move(x, x0, sigma, down) + first * up
        x0_mid = _ve_denoise(spec, model, x_mid, _at(plan.mid_timesteps, i), sigma_mid)
        c2 = (sigma - sigma_mid) / (sigma - sigma_next)  # the first interval's share of the second
        noise = jnp.sqrt(c2) * first + jnp.sqrt(1.0 - c2) * noise_fn(i, 1)  # over [sigma_next, sigma], normalised
        down, up = _ancestral_split(sigma, sigma_next)
        return _euler_move(x, x0_mid, sigma, down) + noise * up

    def last(_: None) -> jax.Array:  # onto sigma 0
        return _euler_move(x, x0, sigma, sigma_next)

    return state._replace(x=jax.lax.cond(sigma_next > 0, stochastic, last, None))


def _dpmpp_2m_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
                   noise_fn: NoiseFn) -> SamplerState:
    """DPM-Solver++(2M) (Lu et al. 2022), midpoint form; ``plan.order[i]`` picks 1st/2nd order.
    ``dpmpp_2m_sde``: its SDE variant (sde-dpmsolver++), which contracts the sample by ``e^-h``
    more and adds fresh noise of std ``sigma_t sqrt(1 - e^-2h)`` (0 onto the final sigma = 0).
    EDM samplers (``spec.sigma_data``) run the same updates on the variance-exploding state
    (``alpha = 1``, as EDMDPMSolverMultistepScheduler), with ``solver_type="heun"``'s second-order term
    where the config asks for it."""
    x = state.x
    states = _ve_coefficients if spec.sigma_data else _vp
    sigma_s = _at(plan.sigmas, i)
    sigma_t = _at(plan.sigmas, i + 1)
    sigma_s1 = _at(plan.sigmas, jnp.maximum(i - 1, 0))  # unused (order 1) at i == 0
    alpha_s, sig_s = states(sigma_s)
    alpha_t, sig_t = states(sigma_t)
    alpha_s1, sig_s1 = states(sigma_s1)
    t = _at(plan.timesteps, i)
    if spec.sigma_data:
        x0 = _edm_denoise(spec, model, x, t, sigma_s)
    else:
        x0, _ = _denoise(spec, model, x, t, 1.0, alpha_s, sig_s)

    lam_t = jnp.log(alpha_t) - jnp.log(sig_t)  # +inf at the final sigma = 0
    lam_s = jnp.log(alpha_s) - jnp.log(sig_s)
    lam_s1 = jnp.log(alpha_s1) - jnp.log(sig_s1)
    h, h_prev = lam_t - lam_s, lam_s - lam_s1
    r = h_prev / h
    d1 = 1.0 / r * (x0 - state.x0_prev)  # [*S] backward difference of x0 predictions
    heun = spec.solver_type == "heun"
    if spec.solver == "dpmpp_2m_sde":
        decay = jnp.exp(-2.0 * h)
        psi = alpha_t * (1.0 - decay)
        first = (sig_t / sig_s * jnp.exp(-h)) * x + psi * x0 + sig_t * jnp.sqrt(1.0 - decay) * noise_fn(i, 0)
        second = first + (alpha_t * ((1.0 - decay) / (-2.0 * h) + 1.0)) * d1 if heun else first + 0.5 * psi * d1
    else:
        phi = alpha_t * (jnp.exp(-h) - 1.0)
        first = sig_t / sig_s * x - phi * x0  # DPM-Solver++(1) == DDIM
        second = first + (alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)) * d1 if heun else first - 0.5 * phi * d1
    # (second may be NaN where order is 1 -- at i == 0 or at sigma_t == 0; where() drops it)
    x_new = jnp.where(_at(plan.order, i) == 2, second, first)
    return SamplerState(x=x_new, x0_prev=x0)


def _dpmpp_2s_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
                   noise_fn: NoiseFn) -> SamplerState:
    """DPM-Solver++(2S) (Lu et al. 2022, singlestep; DPMSolverSinglestepScheduler, "DPM++ 2S"): the steps go in
    pairs (``plan.order`` [1, 2]). The first is DPM-Solver++(1) from sigma_i to sigma_{i+1}; the second goes
    from the pair's start sample (the state's ``x_pair``) at sigma_{i-1} over both steps to sigma_{i+1}, with
    the x0 predictions at sigma_{i-1} and sigma_i (the midpoint form). One model call a step."""
    x = state.x
    sigma_s1 = _at(plan.sigmas, jnp.maximum(i - 1, 0))  # the pair's start (unused where the order is 1)
    alpha_s1, sig_s1 = _vp(sigma_s1)
    alpha_s0, sig_s0 = _vp(_at(plan.sigmas, i))
    alpha_t, sig_t = _vp(_at(plan.sigmas, i + 1))
    x0, _ = _denoise(spec, model, x, _at(plan.timesteps, i), 1.0, alpha_s0, sig_s0)
    lam_t = jnp.log(alpha_t) - jnp.log(sig_t)  # +inf at the final sigma = 0
    lam_s0 = jnp.log(alpha_s0) - jnp.log(sig_s0)
    lam_s1 = jnp.log(alpha_s1) - jnp.log(sig_s1)
    first = sig_t / sig_s0 * x - alpha_t * (jnp.exp(-(lam_t - lam_s0)) - 1.0) * x0  # DPM-Solver++(1) == DDIM
    h, h0 = lam_t - lam_s1, lam_s0 - lam_s1
    phi = alpha_t * (jnp.exp(-h) - 1.0)
    d1 = (h / h0) * (x0 - state.x0_prev)  # [*S] (1 / r0) (m0 - m1), m1 the x0 at the pair's start
    second = sig_t / sig_s1 * state.x_pair - phi * state.x0_prev - 0.5 * phi * d1
    paired = _at(plan.order, i) == 2  # (second is NaN where the order is 1 at i == 0; where() drops it)
    return SamplerState(x=jnp.where(paired, second, first), x0_prev=x0, x_pair=jnp.where(paired, state.x_pair, x))


def _lcm_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
              noise_fn: NoiseFn) -> SamplerState:
    """Latent consistency (Luo et al. 2023): the boundary-conditioned x0 estimate
    ``c_skip(t) x + c_out(t) x0``, re-noised to the next timestep except on the last step."""
    x, t = state.x, _at(plan.timesteps, i)
    ab, ab_prev = _at(plan.alpha_bar, i), _at(plan.alpha_bar_prev, i)
    x0, _ = _denoise(spec, model, x, t, 1.0, jnp.sqrt(ab), jnp.sqrt(1.0 - ab))
    scaled = t * spec.timestep_scaling
    sigma_data2 = 0.25  # sigma_data = 0.5, as diffusers' LCMScheduler
    c_skip = sigma_data2 / (scaled * scaled + sigma_data2)
    c_out = scaled / jnp.sqrt(scaled * scaled + sigma_data2)
    denoised = c_out * x0 + c_skip * x  # [*S]
    renoised = jnp.sqrt(ab_prev) * denoised + jnp.sqrt(1.0 - ab_prev) * noise_fn(i, 0)
    last = i == jnp.asarray(plan.n_steps, jnp.int32) - 1
    return state._replace(x=jnp.where(last, denoised, renoised))


def _tcd_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
              noise_fn: NoiseFn) -> SamplerState:
    """Trajectory consistency (Zheng et al. 2024, TCDScheduler): the x0 / eps estimate moved
    DDIM-like to the intermediate ``s``, then (not on the last step) fresh noise up to the next
    timestep; ``eta`` (gamma) places ``s`` between the next timestep (0: deterministic) and 0."""
    x, t = state.x, _at(plan.timesteps, i)
    ab, ab_prev, ab_s = _at(plan.alpha_bar, i), _at(plan.alpha_bar_prev, i), _at(plan.alpha_bar_mid, i)
    x0, eps = _denoise(spec, model, x, t, 1.0, jnp.sqrt(ab), jnp.sqrt(1.0 - ab))
    noised_s = jnp.sqrt(ab_s) * x0 + jnp.sqrt(1.0 - ab_s) * eps  # [*S] the estimate at s
    ratio = ab_prev / ab_s
    renoised = jnp.sqrt(ratio) * noised_s + jnp.sqrt(1.0 - ratio) * noise_fn(i, 0)
    last = i == jnp.asarray(plan.n_steps, jnp.int32) - 1
    keep = last | (jnp.asarray(plan.eta, jnp.float32) <= 0.0)  # diffusers adds no noise at eta == 0
    return state._replace(x=jnp.where(keep, noised_s, renoised))


def _lambda(sigma: jax.Array) -> jax.Array:
    """log-SNR ``log(alpha) - log(sigma_vp)`` at VE noise level ``sigma`` (+inf at sigma = 0)."""
    alpha, sig = _vp(sigma)
    return jnp.log(alpha) - jnp.log(sig)


def _unipc_coefficients(h: jax.Array, rks: jax.Array, order: jax.Array, solver_type: str,
                        corrector: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """UniPC's scalars for one update of (data) ``order`` 1..3 over log-SNR step ``h``:
    ``(h_phi_1, B_h, rhos)``; ``rhos[k]`` weighs the k-th backward difference (k < order - 1) and,
    for the corrector, ``rhos[order - 1]`` the new model output's difference.

    ``rks`` ``[2]``: the ratios ``r_k`` of the older points' log-SNR offsets to ``h`` (entries past
    the order unused). The rhos solve ``R rho = b`` with ``R[j][k] = r_k ** j`` and ``b_j`` from
    ``phi_{j+1}(h)``; the predictor drops the last row and column (its order 2: rho = 1/2).
    """
    hh = -h  # predict_x0: integrate in -lambda
    h_phi_1 = jnp.expm1(hh)
    b_h = hh if solver_type == "bh1" else jnp.expm1(hh)
    phi = h_phi_1 / hh - 1.0
    b = []
    factorial = 1.0
    for j in range(1, 4):
        b.append(phi * factorial / b_h)
        factorial *= j + 1
        phi = phi / hh - 1.0 / factorial
    b1, b2, b3 = b
    r1, r2 = rks[0], rks[1]
    zero = jnp.zeros_like(h)
    if corrector:
        # order 1: [1/2]; order 2: [[1, 1], [r1, 1]] rho = [b1, b2]; order 3: the 3x3 with (r1, r2, 1)
        o2_0 = (b1 - b2) / (1.0 - r1)
        o2 = jnp.stack([o2_0, b1 - o2_0, zero])
        o3 = _solve3(r1, r2, b1, b2, b3)
        half = jnp.stack([jnp.full_like(h, 0.5), zero, zero])
        rhos = jnp.where(order == 1, half, jnp.where(order == 2, o2, o3))
    else:
        # order 2: [1/2]; order 3: [[1, 1], [r1, r2]] rho = [b1, b2]
        o3_0 = (b2 - r2 * b1) / (r1 - r2)
        o3 = jnp.stack([o3_0, b1 - o3_0, zero])
        half = jnp.stack([jnp.full_like(h, 0.5), zero, zero])
        rhos = jnp.where(order == 3, o3, half)
    return h_phi_1, b_h, rhos


def _solve3(r1: jax.Array, r2: jax.Array, b1: jax.Array, b2: jax.Array, b3: jax.Array) -> jax.Array:
    """Solve ``[[1, 1, 1], [r1, r2, 1], [r1^2, r2^2, 1]] rho = b`` (a Vandermonde system) ``[3]``."""
    m = jnp.stack([jnp.stack([jnp.ones_like(r1), jnp.ones_like(r1), jnp.ones_like(r1)]),
                   jnp.stack([r1, r2, jnp.ones_like(r1)]),
                   jnp.stack([r1 * r1, r2 * r2, jnp.ones_like(r1)])])
    return jnp.linalg.solve(m, jnp.stack([b1, b2, b3]))


def _unipc_update(x_from: jax.Array, m0: jax.Array, diffs: list[jax.Array], rhos: jax.Array, h_phi_1: jax.Array,
                  b_h: jax.Array, sig_from: jax.Array, alpha_to: jax.Array, sig_to: jax.Array) -> jax.Array:
    """``sig_to / sig_from x - alpha_to h_phi_1 m0 - alpha_to B_h sum_k rho_k D_k``: UniP and UniC's shared form."""
    res = sum((rhos[k] * d for k, d in enumerate(diffs)), jnp.zeros_like(x_from))
    return sig_to / sig_from * x_from - alpha_to * h_phi_1 * m0 - alpha_to * b_h * res


def _unipc_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
                noise_fn: NoiseFn) -> SamplerState:
    """UniPC (Zhao et al. 2023), UniPCMultistepScheduler with predict_x0: one model call at the
    step's sample, then UniC corrects that sample with it (``plan.corrector[i]``, order
    ``plan.order[i - 1]``), then UniP predicts the next one (order ``plan.order[i]``).

    Differences of x0 predictions at (data) orders < 3 are multiplied by zero weights; the ones
    that would divide by a zero-length history are masked, so padding never turns into NaN.
    """
    K = spec.solver_order
    hist = state.x0_history  # [K, *S]: x0 of steps i-1, i-2, ...
    x = state.x
    last = jnp.maximum(i - 1, 0)

    def lam(j: jax.Array) -> jax.Array:
        return _lambda(_at(plan.sigmas, jnp.maximum(j, 0)))

    alpha_i, sig_i = _vp(_at(plan.sigmas, i))
    x0, _ = _denoise(spec, model, x, _at(plan.timesteps, i), 1.0, alpha_i, sig_i)
    lam_i = lam(i)

    def differences(m0: jax.Array, older: list[jax.Array], lam0: jax.Array, lams: list[jax.Array], h: jax.Array,
                    order: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        """The ratios ``r_k`` (``[2]``) and differences ``(m_k - m0) / r_k`` used at ``order``."""
        rks, diffs = [], []
        for k, (m, lk) in enumerate(zip(older, lams)):
            used = order > k + 1
            r = jnp.where(used, (lk - lam0) / h, k + 2.0)  # unused: distinct from 1 and each other
            rks.append(r)
            diffs.append(jnp.where(used, (m - m0) / r, 0.0))
        while len(rks) < 2:
            rks.append(jnp.asarray(2.0 + len(rks), jnp.float32))  # unused: keeps the unselected solves regular
        return jnp.stack(rks[:2]), diffs

    # UniC: correct the sample step i - 1 predicted, with the model output just computed
    c_order = _at(plan.order, last)
    _, sig_p = _vp(_at(plan.sigmas, last))
    lam_p = lam(last)
    h_c = lam_i - lam_p
    older = [hist[k] for k in range(1, K)]
    rks, diffs = differences(hist[0], older, lam_p, [lam(i - 1 - k) for k in range(1, K)], h_c, c_order)
    h_phi_1, b_h, rhos = _unipc_coefficients(h_c, rks, c_order, spec.solver_type, corrector=True)
    rho_t = jnp.take(rhos, c_order - 1)
    corrected = _unipc_update(state.x_last, hist[0], diffs + [x0 - hist[0]],
                              jnp.concatenate([rhos[: K - 1], rho_t[None]]) if K > 1 else rho_t[None],
                              h_phi_1, b_h, sig_p, alpha_i, sig_i)
    x = jnp.where(_at(plan.corrector, i), corrected, x)

    # UniP: predict the next sample from x0 of this and the previous steps
    order = _at(plan.order, i)
    alpha_t, sig_t = _vp(_at(plan.sigmas, i + 1))
    h = lam(i + 1) - lam_i
    older = [hist[k] for k in range(0, K - 1)]
    rks, diffs = differences(x0, older, lam_i, [lam(i - k) for k in range(1, K)], h, order)
    h_phi_1, b_h, rhos = _unipc_coefficients(h, rks, order, spec.solver_type, corrector=False)
    # first order has no differences: its B_h term is absent (bh1's B_h is -inf onto sigma = 0)
    x_first = sig_t / sig_i * x - alpha_t * h_phi_1 * x0
    x_new = jnp.where(order == 1, x_first, _unipc_update(x, x0, diffs, rhos, h_phi_1, b_h, sig_i, alpha_t, sig_t))
    new_hist = jnp.concatenate([x0[None], hist[:-1]], axis=0)
    return state._replace(x=x_new, x0_history=new_hist, x_last=x)
def _pndm_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
               noise_fn: NoiseFn) -> SamplerState:
    """PLMS (Liu et al. 2022, PNDMScheduler with skip_prk_steps): a linear multistep combination
    of the raw model outputs, moved by the paper's transfer formula (9) from ``t_i`` to
    ``t_i - T // steps``. Call 1 after a (re)start repeats call 0's timestep: it redoes call 0's
    move from its start with the mean of both outputs (an improved Euler step) and is not kept in
    the history -- diffusers' ``counter`` / ``cur_sample`` / ``ets``, carried in the state."""
    x, t, c = state.x, _at(plan.timesteps, i), state.count
    out = model(x, t)  # PNDM feeds the sample unscaled
    if out.shape != x.shape:
        raise InvalidArgumentError(f"model output shape {out.shape} != sample shape {x.shape}")
    out = out.astype(x.dtype)
    h0, h1, h2 = state.outputs[0], state.outputs[1], state.outputs[2]
    combined = jnp.select(
        [c == 0, c == 1, c == 2, c == 3],
        [out, (out + h0) / 2, (3 * out - h0) / 2, (23 * out - 16 * h0 + 5 * h1) / 12],
        (1 / 24) * (55 * out - 59 * h0 + 37 * h1 - 9 * h2),
    )  # [*S]
    restart = c == 1
    sample = jnp.where(restart, state.x_start, x)
    ab = jnp.where(restart, _at(plan.alpha_bar_mid, i), _at(plan.alpha_bar, i))
    ab_prev = jnp.where(restart, _at(plan.alpha_bar, i), _at(plan.alpha_bar_prev, i))
    if spec.prediction_type == "v_prediction":  # eps from the combined v, at this move's start
        combined = jnp.sqrt(ab) * combined + jnp.sqrt(1.0 - ab) * sample
    denom = ab * jnp.sqrt(1.0 - ab_prev) + jnp.sqrt(ab * (1.0 - ab) * ab_prev)
    x_new = jnp.sqrt(ab_prev / ab) * sample - (ab_prev - ab) * combined / denom
    pushed = jnp.stack([out, h0, h1])
    return SamplerState(x=x_new, count=c + 1, x_start=jnp.where(c == 0, x, state.x_start),
                        outputs=jnp.where(restart, state.outputs, pushed))


def _deis_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
               noise_fn: NoiseFn) -> SamplerState:
    """DEIS (Zhang & Chen 2022), DEISMultistepScheduler's log-rho multistep: the noise predictions
    of this and up to two earlier steps, integrated exactly over ``rho = sigma_vp / alpha`` (the VE
    sigma) against their Lagrange polynomial in ``log rho``; ``plan.order[i]`` (1..3) picks how many.

    The coefficients ``coef_k = F_k(rho_t) - F_k(rho_s0)`` use diffusers' antiderivatives ``F_k``
    (its ``ind_fn``); the log-rho gaps they divide by are masked where an order does not use them,
    so the unselected branches never turn into NaN.
    """
    K = spec.solver_order
    hist = state.eps_history  # [K, *S]: eps of steps i-1, i-2, ...
    x = state.x
    alpha_s, sig_s = _vp(_at(plan.sigmas, i))
    alpha_t, sig_t = _vp(_at(plan.sigmas, i + 1))
    x0, _ = _denoise(spec, model, x, _at(plan.timesteps, i), 1.0, alpha_s, sig_s)
    eps = (x - alpha_s * x0) / sig_s  # [*S] diffusers' convert_model_output: eps from the x0 prediction
    order = _at(plan.order, i)

    h = (jnp.log(alpha_t) - jnp.log(sig_t)) - (jnp.log(alpha_s) - jnp.log(sig_s))
    first = (alpha_t / alpha_s) * x - (sig_t * (jnp.exp(h) - 1.0)) * eps

    def rho(j: jax.Array) -> jax.Array:
        alpha, sig = _vp(_at(plan.sigmas, jnp.maximum(j, 0)))
        return sig / alpha  # as diffusers rounds it (not the plan's sigma itself)

    rt, r0 = rho(i + 1), rho(i)
    lt, l0, l1, l2 = jnp.log(rt), jnp.log(r0), jnp.log(rho(i - 1)), jnp.log(rho(i - 2))

    def gap(a: jax.Array, b: jax.Array, used: jax.Array) -> jax.Array:
        return jnp.where(used, a - b, 1.0)  # a log-rho difference, 1 where the order does not use it

    def f2(t: jax.Array, lt_: jax.Array, lb: jax.Array, lc: jax.Array, used: jax.Array) -> jax.Array:
        return t * (-lc + lt_ - 1.0) / gap(lb, lc, used)

    def f3(t: jax.Array, lt_: jax.Array, lb: jax.Array, lc: jax.Array, ld: jax.Array, used: jax.Array) -> jax.Array:
        num = t * (lc * (ld - lt_ + 1.0) - ld * lt_ + ld + lt_ ** 2 - 2.0 * lt_ + 2.0)
        return num / (gap(lb, lc, used) * gap(lb, ld, used))

    used2, used3 = order >= 2, order >= 3
    x_new = first
    if K >= 2:
        c1 = f2(rt, lt, l0, l1, used2) - f2(r0, l0, l0, l1, used2)
        c2 = f2(rt, lt, l1, l0, used2) - f2(r0, l0, l1, l0, used2)
        second = alpha_t * (x / alpha_s + c1 * eps + c2 * hist[0])
        x_new = jnp.where(used2, second, x_new)
    if K >= 3:
        c1 = f3(rt, lt, l0, l1, l2, used3) - f3(r0, l0, l0, l1, l2, used3)
        c2 = f3(rt, lt, l1, l2, l0, used3) - f3(r0, l0, l1, l2, l0, used3)
        c3 = f3(rt, lt, l2, l0, l1, used3) - f3(r0, l0, l2, l0, l1, used3)
        third = alpha_t * (x / alpha_s + c1 * eps + c2 * hist[0] + c3 * hist[1])
        x_new = jnp.where(used3, third, x_new)
    new_hist = jnp.concatenate([eps[None], hist[:-1]], axis=0)
    return state._replace(x=x_new, eps_history=new_hist)


def _lms_step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array,
              noise_fn: NoiseFn) -> SamplerState:
    """Linear multistep (LMSDiscreteScheduler, order 4): ``x + sum_k c[i, k] d_{i-k}`` over this
    step's derivative and the last three, ``c`` the plan's integrals of their Lagrange polynomials.
    After an img2img start the history is zeros, so its terms drop out as diffusers' ``zip`` drops
    the derivatives it does not have (with the same coefficients)."""
    sigma = _at(plan.sigmas, i)
    d = _derivative(spec, model, state.x, _at(plan.timesteps, i), sigma)  # [*S]
    history = jnp.concatenate([d[None], state.derivatives], axis=0)  # [4, *S]: steps i, i-1, i-2, i-3
    coeffs = _at(plan.lms_coeffs, i)  # [4]
    x_new = state.x + jnp.tensordot(coeffs, history, axes=1)
    return state._replace(x=x_new, derivatives=history[:-1])


_STEP_OF_SOLVER = {
    "ddpm": _ddpm_step,
    "ddim": _ddim_step,
    "euler": _euler_step,
    "euler_a": _euler_a_step,
    "heun": _heun_step,
    "dpmpp_2m": _dpmpp_2m_step,
    "lcm": _lcm_step,
    "tcd": _tcd_step,
    "unipc": _unipc_step,
    "dpmpp_2m_sde": _dpmpp_2m_step,
    "pndm": _pndm_step,
    "deis": _deis_step,
    "lms": _lms_step,
    "dpm2": _dpm2_step,
    "dpm2_a": _dpm2_step,
    "dpmpp_sde": _dpmpp_sde_step,
    "dpmpp_2s": _dpmpp_2s_step,
}
