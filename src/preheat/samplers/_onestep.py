"""Device side: the solvers that remember nothing between steps (their state is the sample alone,
``Sample``): DDPM, DDIM, Euler, Euler ancestral, Heun, DPM2 (and its ancestral form), DPM++ SDE,
LCM and TCD. Each is a ``Solver`` -- ``init`` and ``step`` -- listed at the end of the module.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from preheat.samplers._core import (Model, NoiseFn, Sample, Solver, ancestral_split, at, denoise, derivative,
                                    euler_move, remember_nothing, ve_denoise)
from preheat.samplers._plan import Plan, SolverSpec

__all__ = ["DDPM", "DDIM", "EULER", "EULER_A", "HEUN", "DPM2", "DPM2_A", "DPMPP_SDE", "LCM", "TCD"]


def _ddpm_step(spec: SolverSpec, model: Model, plan: Plan, state: Sample, i: jax.Array,
               noise_fn: NoiseFn) -> Sample:
    """Ancestral DDPM posterior step q(x_prev | x_t, x0) to the next listed timestep."""
    x, t = state.x, at(plan.timesteps, i)
    ab, ab_prev = at(plan.alpha_bar, i), at(plan.alpha_bar_prev, i)
    x0, _ = denoise(spec, model, x, t, 1.0, jnp.sqrt(ab), jnp.sqrt(1.0 - ab))
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


def _ddim_step(spec: SolverSpec, model: Model, plan: Plan, state: Sample, i: jax.Array,
               noise_fn: NoiseFn) -> Sample:
    """DDIM (Song et al. 2021, eq. 12); ``eta`` interpolates towards DDPM's stochasticity."""
    x, t = state.x, at(plan.timesteps, i)
    ab, ab_prev = at(plan.alpha_bar, i), at(plan.alpha_bar_prev, i)
    x0, eps = denoise(spec, model, x, t, 1.0, jnp.sqrt(ab), jnp.sqrt(1.0 - ab))
    var = (1.0 - ab_prev) / (1.0 - ab) * (1.0 - ab / ab_prev)
    std = jnp.asarray(plan.eta, jnp.float32) * jnp.sqrt(var)
    direction = jnp.sqrt(1.0 - ab_prev - std * std) * eps
    x_new = jnp.sqrt(ab_prev) * x0 + direction
    x_new = x_new + std * noise_fn(i, 0)  # std == 0 when eta == 0: adds exactly 0
    return state._replace(x=x_new)


def _euler_step(spec: SolverSpec, model: Model, plan: Plan, state: Sample, i: jax.Array,
                noise_fn: NoiseFn) -> Sample:
    """Euler on the probability-flow ODE in sigma (Karras et al. 2022, Alg. 1 without churn);
    for flow matching, FlowMatchEulerDiscreteScheduler's ``x + (sigma_next - sigma) * v``."""
    sigma, sigma_next = at(plan.sigmas, i), at(plan.sigmas, i + 1)
    d = derivative(spec, model, state.x, at(plan.timesteps, i), sigma)
    return state._replace(x=state.x + d * (sigma_next - sigma))


def _euler_a_step(spec: SolverSpec, model: Model, plan: Plan, state: Sample, i: jax.Array,
                  noise_fn: NoiseFn) -> Sample:
    """Euler to ``sigma_down`` then fresh noise of std ``sigma_up`` (sigma_down^2 + sigma_up^2 = sigma_next^2)."""
    sigma, sigma_next = at(plan.sigmas, i), at(plan.sigmas, i + 1)
    x0 = ve_denoise(spec, model, state.x, at(plan.timesteps, i), sigma)
    sigma_down, sigma_up = ancestral_split(sigma, sigma_next)
    x_new = euler_move(state.x, x0, sigma, sigma_down)
    x_new = x_new + noise_fn(i, 0) * sigma_up
    return state._replace(x=x_new)


def _heun_step(spec: SolverSpec, model: Model, plan: Plan, state: Sample, i: jax.Array,
               noise_fn: NoiseFn) -> Sample:
    """Heun's 2nd-order method (Karras et al. 2022, Alg. 1); plain Euler onto sigma = 0.
    The same for flow matching (FlowMatchHeunDiscreteScheduler), with the model's velocity."""
    x = state.x
    sigma, sigma_next = at(plan.sigmas, i), at(plan.sigmas, i + 1)
    d = derivative(spec, model, x, at(plan.timesteps, i), sigma)
    x_euler = x + d * (sigma_next - sigma)

    def correct(_: None) -> jax.Array:
        # the model at the Euler point; its timestep is the next step's
        d_next = derivative(spec, model, x_euler, at(plan.timesteps, i + 1), sigma_next)
        return x + (d + d_next) / 2 * (sigma_next - sigma)

    x_new = jax.lax.cond(sigma_next > 0, correct, lambda _: x_euler, None)
    return state._replace(x=x_new)


def _dpm2_step(spec: SolverSpec, model: Model, plan: Plan, state: Sample, i: jax.Array, noise_fn: NoiseFn, *,
               ancestral: bool) -> Sample:
    """DPM-Solver-2 (Lu et al. 2022; k-diffusion's ``sample_dpm_2``, KDPM2DiscreteScheduler, "DPM2"): Euler to the
    log-midpoint sigma, the model there, and the whole step along that midpoint's derivative; on the
    last step (midpoint 0) the first call's Euler move onto sigma 0 is the result (one call).

    dpm2_a, its ancestral form (``sample_dpm_2_ancestral``, KDPM2AncestralDiscreteScheduler, "DPM2 a"), aims the
    step at ``sigma_down`` and adds fresh noise of std ``sigma_up``; its midpoint, the geometric mean of
    ``sigma_i`` and ``sigma_down = sigma_{i+1}^2 / sigma_i``, is ``sigma_{i+1}`` (the Plan's ``mid_sigmas``);
    ``ancestral`` (static) picks it.
    """
    x = state.x
    sigma, sigma_next = at(plan.sigmas, i), at(plan.sigmas, i + 1)
    sigma_mid = at(plan.mid_sigmas, i)
    target, sigma_up = ancestral_split(sigma, sigma_next) if ancestral else (sigma_next, None)
    x0 = ve_denoise(spec, model, x, at(plan.timesteps, i), sigma)
    x_mid = euler_move(x, x0, sigma, sigma_mid)  # [*S]

    def second(_: None) -> jax.Array:
        d_mid = derivative(spec, model, x_mid, at(plan.mid_timesteps, i), sigma_mid)
        return x + d_mid * (target - sigma)

    x_new = jax.lax.cond(sigma_mid > 0, second, lambda _: x_mid, None)
    if ancestral:  # sigma_up is 0 on the last step
        x_new = x_new + noise_fn(i, 0) * sigma_up
    return state._replace(x=x_new)


def _dpmpp_sde_step(spec: SolverSpec, model: Model, plan: Plan, state: Sample, i: jax.Array,
                    noise_fn: NoiseFn) -> Sample:
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
    sigma, sigma_next = at(plan.sigmas, i), at(plan.sigmas, i + 1)
    sigma_mid = at(plan.mid_sigmas, i)
    x0 = ve_denoise(spec, model, x, at(plan.timesteps, i), sigma)

    def stochastic(_: None) -> jax.Array:
        first = noise_fn(i, 0)  # [*S] the increment over [sigma_mid, sigma], normalised
        down, up = ancestral_split(sigma, sigma_mid)
        x_mid = euler_move(x, x0, sigma, down) + first * up
        x0_mid = ve_denoise(spec, model, x_mid, at(plan.mid_timesteps, i), sigma_mid)
        c2 = (sigma - sigma_mid) / (sigma - sigma_next)  # the first interval's share of the second
        noise = jnp.sqrt(c2) * first + jnp.sqrt(1.0 - c2) * noise_fn(i, 1)  # over [sigma_next, sigma], normalised
        down, up = ancestral_split(sigma, sigma_next)
        return euler_move(x, x0_mid, sigma, down) + noise * up

    def last(_: None) -> jax.Array:  # onto sigma 0
        return euler_move(x, x0, sigma, sigma_next)

    return state._replace(x=jax.lax.cond(sigma_next > 0, stochastic, last, None))


def _lcm_step(spec: SolverSpec, model: Model, plan: Plan, state: Sample, i: jax.Array,
              noise_fn: NoiseFn) -> Sample:
    """Latent consistency (Luo et al. 2023): the boundary-conditioned x0 estimate
    ``c_skip(t) x + c_out(t) x0``, re-noised to the next timestep except on the last step."""
    x, t = state.x, at(plan.timesteps, i)
    ab, ab_prev = at(plan.alpha_bar, i), at(plan.alpha_bar_prev, i)
    x0, _ = denoise(spec, model, x, t, 1.0, jnp.sqrt(ab), jnp.sqrt(1.0 - ab))
    scaled = t * spec.timestep_scaling
    sigma_data2 = 0.25  # sigma_data = 0.5, as diffusers' LCMScheduler
    c_skip = sigma_data2 / (scaled * scaled + sigma_data2)
    c_out = scaled / jnp.sqrt(scaled * scaled + sigma_data2)
    denoised = c_out * x0 + c_skip * x  # [*S]
    renoised = jnp.sqrt(ab_prev) * denoised + jnp.sqrt(1.0 - ab_prev) * noise_fn(i, 0)
    last = i == jnp.asarray(plan.n_steps, jnp.int32) - 1
    return state._replace(x=jnp.where(last, denoised, renoised))


def _tcd_step(spec: SolverSpec, model: Model, plan: Plan, state: Sample, i: jax.Array,
              noise_fn: NoiseFn) -> Sample:
    """Trajectory consistency (Zheng et al. 2024, TCDScheduler): the x0 / eps estimate moved
    DDIM-like to the intermediate ``s``, then (not on the last step) fresh noise up to the next
    timestep; ``eta`` (gamma) places ``s`` between the next timestep (0: deterministic) and 0."""
    x, t = state.x, at(plan.timesteps, i)
    ab, ab_prev, ab_s = at(plan.alpha_bar, i), at(plan.alpha_bar_prev, i), at(plan.alpha_bar_mid, i)
    x0, eps = denoise(spec, model, x, t, 1.0, jnp.sqrt(ab), jnp.sqrt(1.0 - ab))
    noised_s = jnp.sqrt(ab_s) * x0 + jnp.sqrt(1.0 - ab_s) * eps  # [*S] the estimate at s
    ratio = ab_prev / ab_s
    renoised = jnp.sqrt(ratio) * noised_s + jnp.sqrt(1.0 - ratio) * noise_fn(i, 0)
    last = i == jnp.asarray(plan.n_steps, jnp.int32) - 1
    keep = last | (jnp.asarray(plan.eta, jnp.float32) <= 0.0)  # diffusers adds no noise at eta == 0
    return state._replace(x=jnp.where(keep, noised_s, renoised))


DDPM = Solver(init=remember_nothing, step=_ddpm_step, space="alpha_bar")
DDIM = Solver(init=remember_nothing, step=_ddim_step, space="alpha_bar")
EULER = Solver(init=remember_nothing, step=_euler_step, space="ve")
EULER_A = Solver(init=remember_nothing, step=_euler_a_step, space="ve")
HEUN = Solver(init=remember_nothing, step=_heun_step, space="ve")
DPM2 = Solver(init=remember_nothing, step=functools.partial(_dpm2_step, ancestral=False), space="ve")
DPM2_A = Solver(init=remember_nothing, step=functools.partial(_dpm2_step, ancestral=True), space="ve")
DPMPP_SDE = Solver(init=remember_nothing, step=_dpmpp_sde_step, space="ve")
LCM = Solver(init=remember_nothing, step=_lcm_step, space="alpha_bar")
TCD = Solver(init=remember_nothing, step=_tcd_step, space="alpha_bar")
