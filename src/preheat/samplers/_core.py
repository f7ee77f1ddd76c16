"""Device side, the pieces every solver shares: the model's contract, a solver's (optax-style)
contract, the state of a solver that remembers nothing, and the math written once.

* :class:`Solver` -- a pair of pure functions ``init`` / ``step`` over the solver's own state type
  (a NamedTuple whose first field is the sample ``x``), and what the loop needs to know of it;
* :func:`denoise` -- input scaling, the model call, prediction-type conversion, clipping;
* :func:`euler_move` -- the first-order move along ``(x - x0) / sigma`` (euler_a, dpm2(_a), dpmpp_sde);
* :func:`ancestral_split` -- an ancestral move's ``(sigma_down, sigma_up)`` (euler_a, dpm2_a, dpmpp_sde);
* :func:`derivative` -- ``dx/dsigma`` at a step: from the x0 estimate, or the model's own
  velocity for flow matching (euler and heun serve both).

Notation: the state is ``x = alpha * x0 + sigma * eps``. ddpm/ddim/dpm++ keep the
variance-preserving latent (``alpha**2 + sigma**2 = 1``); euler/euler_a/heun/lms/dpm2(_a)/dpmpp_sde
(``Solver.space == "ve"``) keep the variance-exploding one (``alpha = 1``) and feed the model
``x / sqrt(sigma**2 + 1)``.
Flow matching (``prediction_type == "flow"``: flow_euler, flow_heun) keeps
``x = (1 - sigma) * x0 + sigma * eps``, feeds the model ``x`` itself, and the model returns
the velocity ``dx/dsigma = eps - x0``. EDM samplers (``spec.sigma_data > 0``: edm_euler and
edm_dpmpp_2m(_sde), run by the euler and dpm++ solvers) keep the variance-exploding state and feed
the model ``c_in x`` at ``t = c_noise``; its output gives ``x0 = c_skip x + c_out F``.
"""

from __future__ import annotations

from typing import Callable, Generic, Literal, NamedTuple, TypeVar

import jax
import jax.numpy as jnp

from preheat.errors import InvalidArgumentError
from preheat.samplers._plan import Plan, SolverSpec

__all__ = ["Model", "NoiseFn", "Space", "Solver", "Sample", "remember_nothing", "same_plan", "at", "denoise",
           "ve_denoise", "edm_denoise", "derivative", "euler_move", "ancestral_split", "ve_coefficients", "vp"]

Model = Callable[[jax.Array, jax.Array], jax.Array]
"""``model(x_in, t)``: raw network output (epsilon / v / x0) for input ``x_in`` at float32 scalar ``t``."""

NoiseFn = Callable[[jax.Array, int], jax.Array]
"""``noise_fn(i, k)``: standard-normal noise shaped like the sample, draw ``k`` of step ``i``."""

Space = Literal["ve", "vp", "alpha_bar"]  # a solver's state space (see Solver.space)
State = TypeVar("State")  # a solver's own state: a NamedTuple (a pytree) whose first field is the sample ``x``


def same_plan(plan: Plan, first: jax.Array) -> Plan:
    """A solver that remembers nothing runs a plan the same from any step."""
    return plan


class Solver(NamedTuple, Generic[State]):
    """One solver, optax's way: two pure functions over a state type of its own, and what the
    loop (``samplers.denoise_loop``) and ``noised`` need to know of it. Nothing else is kept between steps."""

    init: Callable[[SolverSpec, jax.Array], State]  # (spec, first sample x) -> the state before any step:
    #   x, and nothing remembered yet (also what a fresh scheduler holds at a restart, the sample kept)
    step: Callable[[SolverSpec, Model, Plan, State, jax.Array, NoiseFn], State]  # one step i of the plan
    space: Space  # how x0 and noise make its sample at a step (``noised``): "ve" x0 + sigma eps; "vp" from the
    #   sigmas, alpha(sigma) x0 + sigma_vp eps; "alpha_bar" sqrt(ab) x0 + sqrt(1 - ab) eps at t_i
    fresh: Callable[[Plan, jax.Array], Plan] = same_plan  # (plan, first) -> the plan as a fresh diffusers
    #   scheduler runs it from step ``first`` on (set_begin_index): a multistep solver's order warms up again


class Sample(NamedTuple):
    """The state of a solver that remembers nothing between steps: the sample alone."""

    x: jax.Array  # [*S] float32: the current sample


def remember_nothing(spec: SolverSpec, x: jax.Array) -> Sample:
    """``Solver.init`` of the one-step solvers: the sample, nothing else."""
    return Sample(x)


def at(table: jax.Array, i: jax.Array) -> jax.Array:
    """``table[i]`` for a numpy or jax table and a possibly traced index."""
    return jnp.asarray(table)[i]


def denoise(spec: SolverSpec, model: Model, x: jax.Array, t: jax.Array, c_in: jax.Array | float,
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


def edm_denoise(spec: SolverSpec, model: Model, x: jax.Array, t: jax.Array, sigma: jax.Array) -> jax.Array:
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


def ve_denoise(spec: SolverSpec, model: Model, x: jax.Array, t: jax.Array, sigma: jax.Array) -> jax.Array:
    """x0 for a variance-exploding state (``alpha = 1``): the model sees ``x / sqrt(sigma^2 + 1)``
    (EDM samplers: ``c_in x``, see :func:`edm_denoise`)."""
    if spec.sigma_data:
        return edm_denoise(spec, model, x, t, sigma)
    c_in = 1.0 / jnp.sqrt(sigma * sigma + 1.0)
    x0, _ = denoise(spec, model, x, t, c_in, 1.0, sigma)
    return x0


def derivative(spec: SolverSpec, model: Model, x: jax.Array, t: jax.Array, sigma: jax.Array) -> jax.Array:
    """``dx/dsigma`` at noise level ``sigma``: the model's velocity for flow matching, else
    ``(x - x0) / sigma`` of the variance-exploding state."""
    if spec.prediction_type == "flow":
        v = model(x, t)  # the model sees the sample unscaled
        if v.shape != x.shape:
            raise InvalidArgumentError(f"model output shape {v.shape} != sample shape {x.shape}")
        return v.astype(x.dtype)
    x0 = ve_denoise(spec, model, x, t, sigma)
    return (x - x0) / sigma  # [*S]


def euler_move(x: jax.Array, x0: jax.Array, sigma: jax.Array, sigma_to: jax.Array) -> jax.Array:
    """One Euler step of ``dx/dsigma = (x - x0) / sigma`` from ``sigma`` to ``sigma_to``, written as
    DPM-Solver-1's ``x0 + (sigma_to / sigma) (x - x0)``: the same value, without ``x + d (sigma_to - sigma)``'s
    cancellation when ``sigma_to << sigma`` (from sigma ~2e4 the sample is ~1e4 and the result ~1: that form
    loses ~1e-3 to an ulp of the sample)."""
    return x0 + (sigma_to / sigma) * (x - x0)  # [*S]


def ancestral_split(sigma: jax.Array, sigma_to: jax.Array) -> tuple[jax.Array, jax.Array]:
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


def ve_coefficients(sigma: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(alpha, sigma) of the variance-exploding state at noise level ``sigma``: ``(1, sigma)``."""
    return jnp.ones_like(sigma), sigma


def vp(sigma: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(alpha, sigma_vp) of the variance-preserving latent at VE noise level ``sigma``."""
    alpha = 1.0 / jnp.sqrt(sigma * sigma + 1.0)
    return alpha, sigma * alpha
