"""Device side: the solvers that remember earlier steps, each with its state type (a NamedTuple,
the sample ``x`` first): DPM-Solver++ 2M (and its SDE form) and 2S, UniPC, PLMS (PNDM), DEIS and LMS.

What each remembers starts empty (zeros, which its first step's weights ignore) and is forgotten
at a restart (``Solver.init``); a fresh diffusers scheduler also warms its order up again from the
first step it runs, which ``Solver.fresh`` writes into the plan. Each is a ``Solver`` listed at the
end of the module.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from preheat.errors import InvalidArgumentError
from preheat.samplers._core import Model, NoiseFn, Solver, at, denoise, derivative, edm_denoise, ve_coefficients, vp
from preheat.samplers._plan import Plan, SolverSpec
from preheat.samplers._rows import LMS_ORDER

__all__ = ["DpmState", "DpmPairState", "UniPCState", "PlmsState", "DeisState", "LmsState", "DPMPP_2M",
           "DPMPP_2M_SDE", "DPMPP_2S", "UNIPC", "PNDM", "DEIS", "LMS"]


class DpmState(NamedTuple):
    """dpmpp_2m, dpmpp_2m_sde: the sample and the previous step's x0 prediction."""

    x: jax.Array  # [*S] float32: the current sample
    x0_prev: jax.Array  # [*S] float32: the previous step's x0 prediction (zeros before the first step)


class DpmPairState(NamedTuple):
    """dpmpp_2s: dpm++'s state and the sample its current singlestep pair started from."""

    x: jax.Array  # [*S] float32: the current sample
    x0_prev: jax.Array  # [*S] float32: the previous step's x0 prediction (zeros before the first step)
    x_pair: jax.Array  # [*S] float32: the sample the current singlestep pair started from


class UniPCState(NamedTuple):
    """unipc: the x0 predictions of the last K steps and the sample UniC corrects."""

    x: jax.Array  # [*S] float32: the current sample
    x0_history: jax.Array  # [K, *S] float32: x0 of steps i-1 .. i-K (K = solver_order)
    x_last: jax.Array  # [*S] float32: the sample step i - 1 started from (UniC's)


class PlmsState(NamedTuple):
    """pndm (PLMS): diffusers' ``counter``, ``cur_sample`` and ``ets``, explicit."""

    x: jax.Array  # [*S] float32: the current sample
    count: jax.Array  # int32 []: calls since init / start (diffusers' counter)
    x_start: jax.Array  # [*S] float32: the sample entering call 0 (call 1 restarts there)
    outputs: jax.Array  # [3, *S] float32: earlier raw model outputs, newest first


class DeisState(NamedTuple):
    """deis: the noise predictions of the last K steps."""

    x: jax.Array  # [*S] float32: the current sample
    eps_history: jax.Array  # [K, *S] float32: eps of steps i-1 .. i-K (K = solver_order)


class LmsState(NamedTuple):
    """lms: the derivatives of the last three steps (its order-4 step weighs them with this one's)."""

    x: jax.Array  # [*S] float32: the current sample
    derivatives: jax.Array  # [3, *S] float32: dx/dsigma of steps i-1 .. i-3


# --- what a fresh start holds ------------------------------------------------------------------


def _dpm_init(spec: SolverSpec, x: jax.Array) -> DpmState:
    return DpmState(x=x, x0_prev=jnp.zeros_like(x))


def _dpm_pair_init(spec: SolverSpec, x: jax.Array) -> DpmPairState:
    return DpmPairState(x=x, x0_prev=jnp.zeros_like(x), x_pair=x)  # the first pair starts at the first sample


def _unipc_init(spec: SolverSpec, x: jax.Array) -> UniPCState:
    return UniPCState(x=x, x0_history=jnp.zeros((spec.solver_order, *x.shape), x.dtype), x_last=x)


def _plms_init(spec: SolverSpec, x: jax.Array) -> PlmsState:
    return PlmsState(x=x, count=jnp.int32(0), x_start=jnp.zeros_like(x), outputs=jnp.zeros((3, *x.shape), x.dtype))


def _deis_init(spec: SolverSpec, x: jax.Array) -> DeisState:
    return DeisState(x=x, eps_history=jnp.zeros((spec.solver_order, *x.shape), x.dtype))


def _lms_init(spec: SolverSpec, x: jax.Array) -> LmsState:
    # none yet: the first steps' missing terms weigh zeros (diffusers drops them)
    return LmsState(x=x, derivatives=jnp.zeros((LMS_ORDER - 1, *x.shape), x.dtype))


def _first_order_first(plan: Plan, first: jax.Array) -> Plan:
    """dpm++: no history at the first step run: first order, as diffusers."""
    return plan._replace(order=jnp.asarray(plan.order).at[first].set(1))


def _order_warms_up(plan: Plan, first: jax.Array) -> Plan:
    """deis (unipc too): the order warms up from the first step run, one more stored prediction a step."""
    warm = jnp.arange(jnp.shape(plan.order)[0], dtype=jnp.int32) - first + 1
    return plan._replace(order=jnp.minimum(jnp.asarray(plan.order), warm))


def _unipc_fresh(plan: Plan, first: jax.Array) -> Plan:
    """unipc: its order warms up, and there is nothing to correct at the first step run."""
    plan = _order_warms_up(plan, first)
    return plan._replace(corrector=jnp.asarray(plan.corrector).at[first].set(False))


# --- solvers ------------------------------------------------------------------------------------


def _dpmpp_2m_step(spec: SolverSpec, model: Model, plan: Plan, state: DpmState, i: jax.Array, noise_fn: NoiseFn,
                   *, sde: bool) -> DpmState:
    """DPM-Solver++(2M) (Lu et al. 2022), midpoint form; ``plan.order[i]`` picks 1st/2nd order.
    ``dpmpp_2m_sde`` (``sde``, static): its SDE variant (sde-dpmsolver++), which contracts the sample by ``e^-h``
    more and adds fresh noise of std ``sigma_t sqrt(1 - e^-2h)`` (0 onto the final sigma = 0).
    EDM samplers (``spec.sigma_data``) run the same updates on the variance-exploding state
    (``alpha = 1``, as EDMDPMSolverMultistepScheduler), with ``solver_type="heun"``'s second-order term
    where the config asks for it."""
    x = state.x
    states = ve_coefficients if spec.sigma_data else vp
    sigma_s = at(plan.sigmas, i)
    sigma_t = at(plan.sigmas, i + 1)
    sigma_s1 = at(plan.sigmas, jnp.maximum(i - 1, 0))  # unused (order 1) at i == 0
    alpha_s, sig_s = states(sigma_s)
    alpha_t, sig_t = states(sigma_t)
    alpha_s1, sig_s1 = states(sigma_s1)
    t = at(plan.timesteps, i)
    if spec.sigma_data:
        x0 = edm_denoise(spec, model, x, t, sigma_s)
    else:
        x0, _ = denoise(spec, model, x, t, 1.0, alpha_s, sig_s)

    lam_t = jnp.log(alpha_t) - jnp.log(sig_t)  # +inf at the final sigma = 0
    lam_s = jnp.log(alpha_s) - jnp.log(sig_s)
    lam_s1 = jnp.log(alpha_s1) - jnp.log(sig_s1)
    h, h_prev = lam_t - lam_s, lam_s - lam_s1
    r = h_prev / h
    d1 = 1.0 / r * (x0 - state.x0_prev)  # [*S] backward difference of x0 predictions
    heun = spec.solver_type == "heun"
    if sde:
        decay = jnp.exp(-2.0 * h)
        psi = alpha_t * (1.0 - decay)
        first = (sig_t / sig_s * jnp.exp(-h)) * x + psi * x0 + sig_t * jnp.sqrt(1.0 - decay) * noise_fn(i, 0)
        second = first + (alpha_t * ((1.0 - decay) / (-2.0 * h) + 1.0)) * d1 if heun else first + 0.5 * psi * d1
    else:
        phi = alpha_t * (jnp.exp(-h) - 1.0)
        first = sig_t / sig_s * x - phi * x0  # DPM-Solver++(1) == DDIM
        second = first + (alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)) * d1 if heun else first - 0.5 * phi * d1
    # (second may be NaN where order is 1 -- at i == 0 or at sigma_t == 0; where() drops it)
    x_new = jnp.where(at(plan.order, i) == 2, second, first)
    return DpmState(x=x_new, x0_prev=x0)


def _dpmpp_2s_step(spec: SolverSpec, model: Model, plan: Plan, state: DpmPairState, i: jax.Array,
                   noise_fn: NoiseFn) -> DpmPairState:
    """DPM-Solver++(2S) (Lu et al. 2022, singlestep; DPMSolverSinglestepScheduler, "DPM++ 2S"): the steps go in
    pairs (``plan.order`` [1, 2]). The first is DPM-Solver++(1) from sigma_i to sigma_{i+1}; the second goes
    from the pair's start sample (the state's ``x_pair``) at sigma_{i-1} over both steps to sigma_{i+1}, with
    the x0 predictions at sigma_{i-1} and sigma_i (the midpoint form). One model call a step."""
    x = state.x
    sigma_s1 = at(plan.sigmas, jnp.maximum(i - 1, 0))  # the pair's start (unused where the order is 1)
    alpha_s1, sig_s1 = vp(sigma_s1)
    alpha_s0, sig_s0 = vp(at(plan.sigmas, i))
    alpha_t, sig_t = vp(at(plan.sigmas, i + 1))
    x0, _ = denoise(spec, model, x, at(plan.timesteps, i), 1.0, alpha_s0, sig_s0)
    lam_t = jnp.log(alpha_t) - jnp.log(sig_t)  # +inf at the final sigma = 0
    lam_s0 = jnp.log(alpha_s0) - jnp.log(sig_s0)
    lam_s1 = jnp.log(alpha_s1) - jnp.log(sig_s1)
    first = sig_t / sig_s0 * x - alpha_t * (jnp.exp(-(lam_t - lam_s0)) - 1.0) * x0  # DPM-Solver++(1) == DDIM
    h, h0 = lam_t - lam_s1, lam_s0 - lam_s1
    phi = alpha_t * (jnp.exp(-h) - 1.0)
    d1 = (h / h0) * (x0 - state.x0_prev)  # [*S] (1 / r0) (m0 - m1), m1 the x0 at the pair's start
    second = sig_t / sig_s1 * state.x_pair - phi * state.x0_prev - 0.5 * phi * d1
    paired = at(plan.order, i) == 2  # (second is NaN where the order is 1 at i == 0; where() drops it)
    return DpmPairState(x=jnp.where(paired, second, first), x0_prev=x0, x_pair=jnp.where(paired, state.x_pair, x))


def _lambda(sigma: jax.Array) -> jax.Array:
    """log-SNR ``log(alpha) - log(sigma_vp)`` at VE noise level ``sigma`` (+inf at sigma = 0)."""
    alpha, sig = vp(sigma)
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


def _unipc_step(spec: SolverSpec, model: Model, plan: Plan, state: UniPCState, i: jax.Array,
                noise_fn: NoiseFn) -> UniPCState:
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
        return _lambda(at(plan.sigmas, jnp.maximum(j, 0)))

    alpha_i, sig_i = vp(at(plan.sigmas, i))
    x0, _ = denoise(spec, model, x, at(plan.timesteps, i), 1.0, alpha_i, sig_i)
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
    c_order = at(plan.order, last)
    _, sig_p = vp(at(plan.sigmas, last))
    lam_p = lam(last)
    h_c = lam_i - lam_p
    older = [hist[k] for k in range(1, K)]
    rks, diffs = differences(hist[0], older, lam_p, [lam(i - 1 - k) for k in range(1, K)], h_c, c_order)
    h_phi_1, b_h, rhos = _unipc_coefficients(h_c, rks, c_order, spec.solver_type, corrector=True)
    rho_t = jnp.take(rhos, c_order - 1)
    corrected = _unipc_update(state.x_last, hist[0], diffs + [x0 - hist[0]],
                              jnp.concatenate([rhos[: K - 1], rho_t[None]]) if K > 1 else rho_t[None],
                              h_phi_1, b_h, sig_p, alpha_i, sig_i)
    x = jnp.where(at(plan.corrector, i), corrected, x)

    # UniP: predict the next sample from x0 of this and the previous steps
    order = at(plan.order, i)
    alpha_t, sig_t = vp(at(plan.sigmas, i + 1))
    h = lam(i + 1) - lam_i
    older = [hist[k] for k in range(0, K - 1)]
    rks, diffs = differences(x0, older, lam_i, [lam(i - k) for k in range(1, K)], h, order)
    h_phi_1, b_h, rhos = _unipc_coefficients(h, rks, order, spec.solver_type, corrector=False)
    # first order has no differences: its B_h term is absent (bh1's B_h is -inf onto sigma = 0)
    x_first = sig_t / sig_i * x - alpha_t * h_phi_1 * x0
    x_new = jnp.where(order == 1, x_first, _unipc_update(x, x0, diffs, rhos, h_phi_1, b_h, sig_i, alpha_t, sig_t))
    new_hist = jnp.concatenate([x0[None], hist[:-1]], axis=0)
    return state._replace(x=x_new, x0_history=new_hist, x_last=x)


def _pndm_step(spec: SolverSpec, model: Model, plan: Plan, state: PlmsState, i: jax.Array,
               noise_fn: NoiseFn) -> PlmsState:
    """PLMS (Liu et al. 2022, PNDMScheduler with skip_prk_steps): a linear multistep combination
    of the raw model outputs, moved by the paper's transfer formula (9) from ``t_i`` to
    ``t_i - T // steps``. Call 1 after a (re)start repeats call 0's timestep: it redoes call 0's
    move from its start with the mean of both outputs (an improved Euler step) and is not kept in
    the history -- diffusers' ``counter`` / ``cur_sample`` / ``ets``, carried in the state."""
    x, t, c = state.x, at(plan.timesteps, i), state.count
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
    ab = jnp.where(restart, at(plan.alpha_bar_mid, i), at(plan.alpha_bar, i))
    ab_prev = jnp.where(restart, at(plan.alpha_bar, i), at(plan.alpha_bar_prev, i))
    if spec.prediction_type == "v_prediction":  # eps from the combined v, at this move's start
        combined = jnp.sqrt(ab) * combined + jnp.sqrt(1.0 - ab) * sample
    denom = ab * jnp.sqrt(1.0 - ab_prev) + jnp.sqrt(ab * (1.0 - ab) * ab_prev)
    x_new = jnp.sqrt(ab_prev / ab) * sample - (ab_prev - ab) * combined / denom
    pushed = jnp.stack([out, h0, h1])
    return PlmsState(x=x_new, count=c + 1, x_start=jnp.where(c == 0, x, state.x_start),
                        outputs=jnp.where(restart, state.outputs, pushed))


def _deis_step(spec: SolverSpec, model: Model, plan: Plan, state: DeisState, i: jax.Array,
               noise_fn: NoiseFn) -> DeisState:
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
    alpha_s, sig_s = vp(at(plan.sigmas, i))
    alpha_t, sig_t = vp(at(plan.sigmas, i + 1))
    x0, _ = denoise(spec, model, x, at(plan.timesteps, i), 1.0, alpha_s, sig_s)
    eps = (x - alpha_s * x0) / sig_s  # [*S] diffusers' convert_model_output: eps from the x0 prediction
    order = at(plan.order, i)

    h = (jnp.log(alpha_t) - jnp.log(sig_t)) - (jnp.log(alpha_s) - jnp.log(sig_s))
    first = (alpha_t / alpha_s) * x - (sig_t * (jnp.exp(h) - 1.0)) * eps

    def rho(j: jax.Array) -> jax.Array:
        alpha, sig = vp(at(plan.sigmas, jnp.maximum(j, 0)))
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


def _lms_step(spec: SolverSpec, model: Model, plan: Plan, state: LmsState, i: jax.Array,
              noise_fn: NoiseFn) -> LmsState:
    """Linear multistep (LMSDiscreteScheduler, order 4): ``x + sum_k c[i, k] d_{i-k}`` over this
    step's derivative and the last three, ``c`` the plan's integrals of their Lagrange polynomials.
    After an img2img start the history is zeros, so its terms drop out as diffusers' ``zip`` drops
    the derivatives it does not have (with the same coefficients)."""
    sigma = at(plan.sigmas, i)
    d = derivative(spec, model, state.x, at(plan.timesteps, i), sigma)  # [*S]
    history = jnp.concatenate([d[None], state.derivatives], axis=0)  # [4, *S]: steps i, i-1, i-2, i-3
    coeffs = at(plan.lms_coeffs, i)  # [4]
    x_new = state.x + jnp.tensordot(coeffs, history, axes=1)
    return state._replace(x=x_new, derivatives=history[:-1])


DPMPP_2M = Solver(init=_dpm_init, step=functools.partial(_dpmpp_2m_step, sde=False), space="vp",
                  fresh=_first_order_first)
DPMPP_2M_SDE = Solver(init=_dpm_init, step=functools.partial(_dpmpp_2m_step, sde=True), space="vp",
                      fresh=_first_order_first)
DPMPP_2S = Solver(init=_dpm_pair_init, step=_dpmpp_2s_step, space="vp", fresh=_first_order_first)
UNIPC = Solver(init=_unipc_init, step=_unipc_step, space="vp", fresh=_unipc_fresh)
PNDM = Solver(init=_plms_init, step=_pndm_step, space="alpha_bar")  # its counter restarts with the state
DEIS = Solver(init=_deis_init, step=_deis_step, space="vp", fresh=_order_warms_up)
LMS = Solver(init=_lms_init, step=_lms_step, space="ve")
