"""Device side: the sampling loop, generic over the solvers (``init`` + ``lax.fori_loop`` of ``step``).

Every solver sees the model only as ``model(x_in, t) -> raw output`` and reads its schedule from
the ``Plan`` at a (possibly traced) step index ``i``; nothing is kept between calls but the state,
a NamedTuple of the solver's own type (``_core.Sample`` for the solvers that remember nothing,
``_multistep``'s for the others). The loop reads only the state's sample ``x``; what else a
solver carries, how it starts afresh and in which state space it lives is its ``Solver``'s.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from preheat.errors import InvalidArgumentError
from preheat.progress import report_step
from preheat.samplers import _multistep as M
from preheat.samplers import _onestep as O
from preheat.samplers._core import Model, NoiseFn, Sample, Solver, at, vp
from preheat.samplers._plan import TWO_CALL_SOLVERS, Plan, SolverSpec

__all__ = ["SamplerState", "Start", "Model", "NoiseFn", "init", "step", "denoise_loop", "noised", "BLEND_SOLVERS", "SOLVERS"]

# SolverSpec.solver -> its Solver (the traced update rule and its state); Karras-ness is schedule data, not code
SOLVERS: dict[str, Solver] = {
    "ddpm": O.DDPM,
    "ddim": O.DDIM,
    "euler": O.EULER,
    "euler_a": O.EULER_A,
    "heun": O.HEUN,
    "dpmpp_2m": M.DPMPP_2M,
    "lcm": O.LCM,
    "tcd": O.TCD,
    "unipc": M.UNIPC,
    "dpmpp_2m_sde": M.DPMPP_2M_SDE,
    "pndm": M.PNDM,
    "deis": M.DEIS,
    "lms": M.LMS,
    "dpm2": O.DPM2,
    "dpm2_a": O.DPM2_A,
    "dpmpp_sde": O.DPMPP_SDE,
    "dpmpp_2s": M.DPMPP_2S,
}

SamplerState = (Sample | M.DpmState | M.DpmPairState | M.UniPCState | M.PlmsState | M.DeisState | M.LmsState)
"""The state of any solver: a NamedTuple (a pytree; the ``fori_loop`` carry) whose first field is the sample ``x``."""

# Mask blending needs one blend per scheduler call; Heun's and DPM2's two calls per step are one step here.
BLEND_SOLVERS: tuple[str, ...] = tuple(name for name in SOLVERS if name not in TWO_CALL_SOLVERS)


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


def _solver(spec: SolverSpec) -> Solver:
    try:
        return SOLVERS[spec.solver]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown solver {spec.solver!r} in SolverSpec; supported: {', '.join(SOLVERS)}"
        ) from None


def _first_sample(plan: Plan, noise: jax.Array) -> jax.Array:
    """Standard-normal ``noise`` scaled into the first sample (diffusers' ``init_noise_sigma``)."""
    return jnp.asarray(noise, jnp.float32) * jnp.asarray(plan.init_noise_sigma, jnp.float32)


def init(spec: SolverSpec, plan: Plan, noise: jax.Array) -> SamplerState:
    """The solver's state before its first step, from standard-normal ``noise`` scaled by ``init_noise_sigma``."""
    return _solver(spec).init(spec, _first_sample(plan, noise))


def step(spec: SolverSpec, model: Model, plan: Plan, state: SamplerState, i: jax.Array | int,
         noise_fn: NoiseFn) -> SamplerState:
    """Advance ``state`` by step ``i`` of ``plan`` (``0 <= i < plan.n_steps``)."""
    return _solver(spec).step(spec, model, plan, state, jnp.asarray(i, jnp.int32), noise_fn)


def denoise_loop(spec: SolverSpec, model: Model, plan: Plan, noise: jax.Array, noise_fn: NoiseFn,
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
    solver = _solver(spec)
    first = jnp.int32(0)
    n_steps = jnp.asarray(plan.n_steps, jnp.int32)
    x = _first_sample(plan, noise)
    if start is not None:
        first = jnp.asarray(start.index, jnp.int32)
        x = jnp.where(start.pure_noise, x, noised(spec, plan, start.x0, noise, first))
    state = solver.init(spec, x)

    def segment(plan: Plan, begin: jax.Array, end: jax.Array, state: SamplerState) -> SamplerState:
        def body(i: jax.Array, s: SamplerState) -> SamplerState:
            s = solver.step(spec, model, plan, s, i, noise_fn)
            if start is not None and start.keep is not None:
                # diffusers' inpaint loop: the kept region is x0 at the next step's level (x0 itself at the end)
                last = i == n_steps - 1
                kept = jnp.where(last, start.x0, noised(spec, plan, start.x0, noise, i + 1))
                s = s._replace(x=(1.0 - start.keep) * kept + start.keep * s.x)
            if progress:
                report_step(jnp.asarray(plan.progress_id, jnp.int32), i + 1 - first, n_steps - first, s.x)
            return s

        return jax.lax.fori_loop(begin, end, body, state)

    begun = plan if start is None else solver.fresh(plan, first)  # from noise: the plan is the fresh one
    if restart is None:
        return segment(begun, first, n_steps, state).x
    turn = jnp.clip(jnp.asarray(restart, jnp.int32), first, n_steps)
    state = segment(begun, first, turn, state)
    state = solver.init(spec, state.x)  # what a fresh scheduler carries: nothing yet, the sample kept
    return segment(solver.fresh(plan, turn), turn, n_steps, state).x


def noised(spec: SolverSpec, plan: Plan, x0: jax.Array, noise: jax.Array, i: jax.Array | int) -> jax.Array:
    """``x0`` at step ``i``'s noise level in the solver's own state, as the diffusers scheduler's
    ``add_noise`` (flow: ``scale_noise``) puts it: VE ``x0 + sigma eps`` (EDM samplers too); dpm++ ``alpha(sigma) x0 +
    sigma_vp eps`` from its sigmas (unipc and deis alike); ddpm/ddim/lcm/tcd/pndm ``sqrt(ab) x0 + sqrt(1 - ab) eps`` at
    ``t_i`` (``Solver.space``)."""
    i = jnp.asarray(i, jnp.int32)
    x0, noise = jnp.asarray(x0, jnp.float32), jnp.asarray(noise, jnp.float32)
    if spec.prediction_type == "flow":
        sigma = at(plan.sigmas, i)
        return sigma * noise + (1.0 - sigma) * x0
    space = "ve" if spec.sigma_data else _solver(spec).space  # EDM: variance exploding
    if space == "ve":
        return x0 + noise * at(plan.sigmas, i)
    if space == "vp":
        alpha, sigma = vp(at(plan.sigmas, i))
        return alpha * x0 + sigma * noise
    ab = at(plan.alpha_bar, i)
    return jnp.sqrt(ab) * x0 + jnp.sqrt(1.0 - ab) * noise
