"""Parity with diffusers' schedulers over a grid of configs, every step compared.

What "exact" means here:

* Schedules -- the model timesteps and the sigmas -- must be *bitwise* equal: diffusers'
  values (int64 or float32) and ours (float32) are both cast to float64, which is lossless,
  and compared with ``==``. They start from two tables that torch computes with kernels it
  picks per CPU (the betas' ``linspace`` and the training sigmas' float32 ``** 0.5``, which
  may be 1 ulp off at entries that differ from one processor to the next;
  test_sampler_schedules bounds both against ours). Here we inject torch's own tables into
  ``make_plan``, so that everything computed from them is checked bit for bit on any CPU.
  ``init_noise_sigma`` is ``sqrt(max ** 2 + 1)`` for "leading" spacing: ours is exact (IEEE
  sqrt, checked against float64), torch's within 1 ulp of it.
* Samples after every step: ours (float32 jax/XLA) vs diffusers (float32 torch), fed the same
  initial noise, the same per-step noise and the same fake model. They cannot be bitwise equal
  (XLA fuses multiply-adds into FMAs, rewrites 1/sqrt as rsqrt, and its tanh/sin differ from
  torch's by an ulp), so we require ``assert_allclose(rtol=1e-5, atol=1e-5 + 4 * floor_i)``
  where ``floor_i`` is diffusers' *own* float32 noise floor at step i: how far its result moves
  when the sample entering each call and each model output are nudged by one ulp (and, for deis,
  each ``log``/``exp`` its step computes: ``sampler_ref.TRANSCENDENTAL_NUDGED``).
  On well-conditioned steps ``floor_i`` is ~1e-6 and this is the plain 1e-5 check. It matters
  only where float32 cancellation is inherent, i.e. sigma-space steps from sigma_max ~ 2e4
  (``squaredcos_cap_v2``) or ~157 (``linear``) down to O(1), where diffusers' result itself
  carries errors up to ~1e-2 (Heun: ~10, as the second stage divides by the small sigma). The nudged
  run also moves each step's result by one ulp of the sample that entered it, per element: the step
  ``x + d * dt`` rounds at that scale, and which operations round differs with XLA's fusions and the
  CPU (zero-terminal-SNR Euler's first step from sigma ~4096 returns O(10) from two terms of
  O(4096 |x_T|); ours and diffusers' differ there by one ulp of those in a fifth of the elements on
  an Intel Xeon, in none on an AMD EPYC), a rounding a nudged input cannot show where the step
  contracts it. Where the step does not cancel, that is an ulp of its result, well inside rtol.
  Measured (2 x 8 x 8 x 3 samples, this grid): our discrepancy never exceeded ~1x floor_i (pndm:
  1.45x, at squaredcos_cap_v2's t = 999, where its transfer divides by alphas_cumprod ~ 1e-9), and
  ``test_negative_controls`` shows that a 1-timestep slip already breaks the check.
* The ancestral samplers (euler_a, dpm2_a, dpmpp_sde: ``sampler_ref.FLOAT64_REFERENCE``) are compared with
  diffusers' own code run in float64, its tables too, and the floor is the larger of its float32 run's and
  of its float64 run nudged by float32 ulps. Their float32 ``sigma_down`` cancels where ours does not: from
  a cosine schedule's sigma ~2e4 it is off by percents (dpm2_a's midpoint with it) or 0, where
  KDPM2Ancestral's whole run is NaN (those cases: ``test_dpm2_a_where_diffusers_is_nan``).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np
import pytest

from preheat.samplers import DIFFUSION_SAMPLERS
from preheat.samplers._tables import CLASS_DEFAULTS
from tests._support.sampler_ref import check_parity, diffusers_scheduler, ours_for
from tests._support.tiers import covering_marks

BETAS = {
    "linear": {"beta_schedule": "linear", "beta_start": 0.0001, "beta_end": 0.02},
    "scaled": {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012},
    "cosine": {"beta_schedule": "squaredcos_cap_v2"},
}
PREDICTIONS = ("epsilon", "v_prediction", "sample")
SPACINGS = {
    "linspace": {"timestep_spacing": "linspace"},
    "trailing": {"timestep_spacing": "trailing"},
    "leading": {"timestep_spacing": "leading"},
    "leading+1": {"timestep_spacing": "leading", "steps_offset": 1},
}
STEPS = (1, 7, 20)

# Sampler-specific options beyond the class defaults. Each is crossed with every
# beta schedule x prediction type x spacing, the step count rotating through STEPS.
EXTRAS: dict[str, list[dict[str, Any]]] = {
    "ddpm": [
        {"variance_type": v, "clip_sample": c}
        for v, c in itertools.product(("fixed_small", "fixed_small_log", "fixed_large"), (True, False))
        if (v, c) != ("fixed_small", True)  # the default, already in the base grid
    ],
    "ddim": [
        {"eta": e, "clip_sample": c, "set_alpha_to_one": a}
        for e, c, a in itertools.product((0.0, 0.5), (True, False), (True, False))
        if (e, c, a) != (0.0, True, True)
    ],
    "euler": [{"use_karras_sigmas": True}],
    "heun": [{"use_karras_sigmas": True}, {"clip_sample": True}],
    "euler_a": [],
    "dpmpp_2m": [],
    "dpmpp_2m_karras": [],
    # spacing and offset are not read by LCMScheduler: the grid still crosses them (ignored alike)
    "lcm": [{"original_inference_steps": 25}, {"timestep_scaling": 4.0, "clip_sample": True},
            {"original_inference_steps": 20}],  # 20 steps: the whole grid
    # eta (gamma) 0.3 is TCDScheduler.step's own default, 1.0 the Hyper-SD card's; clip_sample is
    # not read by its step (ignored alike)
    "tcd": [{"eta": 0.3}, {"eta": 1.0}, {"eta": 0.7, "original_inference_steps": 25},
            {"eta": 0.5, "original_inference_steps": 20, "clip_sample": True}],
    # the orders, both B(h), a corrector list and Karras; bh1 and lower_order_final=False need
    # final_sigmas_type="sigma_min" (onto sigma 0 diffusers' own last step is NaN / inf with them)
    "unipc": [{"solver_order": 3}, {"solver_order": 1, "use_karras_sigmas": True},
              {"solver_type": "bh1", "final_sigmas_type": "sigma_min"},
              {"solver_order": 3, "lower_order_final": False, "final_sigmas_type": "sigma_min",
               "disable_corrector": [0, 3]}],
    "dpmpp_2m_sde": [],
    "dpmpp_2m_sde_karras": [],
    # set_alpha_to_one is PNDMScheduler's only own key (final alpha 1 vs alphas_cumprod[0])
    "pndm": [{"set_alpha_to_one": True}],
    # its orders (20 steps: no wind-down, a third-order last step), Karras (the last step is zero
    # long) and the wind-down off
    "deis": [{"solver_order": 3}, {"solver_order": 1, "use_karras_sigmas": True},
             {"solver_order": 3, "use_karras_sigmas": True}, {"lower_order_final": False}],
    "lms": [{"use_karras_sigmas": True}],
    "dpm2": [{"use_karras_sigmas": True}],
    "dpm2_a": [{"use_karras_sigmas": True}],
    "dpmpp_sde": [{"use_karras_sigmas": True}],
    # spacing and offset are not DPMSolverSinglestepScheduler's keys: the grid still crosses them (ignored alike)
    "dpmpp_2s": [],
    "dpmpp_2s_karras": [],
}
# Samplers added later whose base grid rotates the step count (as EXTRAS do) instead of crossing
# it: their schedules are another's (dpm++'s) or DDIM's grid, so a third of the cases cover them.
ROTATED: tuple[str, ...] = ("dpmpp_2m_sde", "dpmpp_2m_sde_karras", "pndm", "deis", "lms", "dpm2", "dpm2_a",
                            "dpmpp_sde", "dpmpp_2s", "dpmpp_2s_karras")
# prediction types a sampler's diffusers class refuses (test_sampler_config checks ours refuses them)
UNSUPPORTED_PREDICTIONS: dict[str, tuple[str, ...]] = {"pndm": ("sample",), "dpm2": ("sample",), "dpm2_a": ("sample",),
                                                       "dpmpp_sde": ("sample",)}


def _diffusers_is_nan(sampler: str, cfg: dict[str, Any], steps: int) -> bool:
    """KDPM2Ancestral's own float32 tables hold NaN (its cancelling sigma_down is 0 before the last step:
    a cosine schedule's first step from ~2e4); test_dpm2_a_where_diffusers_is_nan takes those cases."""
    if sampler != "dpm2_a":
        return False
    sched = diffusers_scheduler(sampler, cfg)
    sched.set_timesteps(steps)
    return bool(np.isnan(sched.sigmas_interpol.numpy()).any())


def _config(beta: str, pred: str, spacing: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"_class_name": "SomeScheduler", **BETAS[beta], "prediction_type": pred, **SPACINGS[spacing], **extra}


def _cases() -> list[Any]:
    """The whole grid; ``make test`` runs the cases in which every two axis values meet once
    (``tests/_support/tiers.covering_marks``: a third; pndm, with two prediction types, meets
    only 8 of its 12 (beta, spacing) pairs there), ``make test-slow`` the rest."""
    cases = []
    for sampler in DIFFUSION_SAMPLERS:
        predictions = [p for p in PREDICTIONS if p not in UNSUPPORTED_PREDICTIONS.get(sampler, ())]
        axes = [list(enumerate(BETAS)), list(enumerate(predictions)), list(enumerate(SPACINGS))]
        if sampler in ROTATED:
            for j, ((i, b), (k, p), (m, s)) in enumerate(itertools.product(*axes)):
                n = STEPS[j % len(STEPS)]
                if _diffusers_is_nan(sampler, _config(b, p, s, {}), n):
                    continue
                cases.append(pytest.param(sampler, b, p, s, n, {}, id=f"{sampler}-{b}-{p}-{s}-{n}",
                                          marks=covering_marks(i, k, m)))
        else:
            for (i, b), (k, p), (m, s), (q, n) in itertools.product(*axes, list(enumerate(STEPS))):
                cases.append(pytest.param(sampler, b, p, s, n, {}, id=f"{sampler}-{b}-{p}-{s}-{n}",
                                          marks=covering_marks(i, k, m, q)))
        for extra in EXTRAS[sampler]:
            tag = ",".join(f"{k}={v}" for k, v in extra.items())
            for j, ((i, b), (k, p), (m, s)) in enumerate(itertools.product(*axes)):
                n = STEPS[j % len(STEPS)]
                if _diffusers_is_nan(sampler, _config(b, p, s, extra), n):
                    continue
                cases.append(pytest.param(sampler, b, p, s, n, extra, id=f"{sampler}-{b}-{p}-{s}-{n}-{tag}",
                                          marks=covering_marks(i, k, m)))
    return cases


@pytest.mark.parametrize("sampler,beta,pred,spacing,steps,extra", _cases())
def test_matches_diffusers(sampler: str, beta: str, pred: str, spacing: str, steps: int,
                           extra: dict[str, Any], monkeypatch) -> None:
    extra = dict(extra)
    eta = extra.pop("eta", 0.0)
    check_parity(sampler, _config(beta, pred, spacing, extra), steps, eta, monkeypatch)


@pytest.mark.parametrize("sampler", DIFFUSION_SAMPLERS)
def test_negative_controls(sampler: str, monkeypatch) -> None:
    """The parity check is sharp: it fails for a plan whose model timesteps are off by one, and
    for a 1e-4 relative error in one schedule value (ddim: eta 0 instead of 0.5)."""
    cfg = {**BETAS["scaled"], "prediction_type": "epsilon"}
    eta = 0.5 if sampler in ("ddim", "tcd") else 0.0
    _, plan = ours_for(cfg, sampler, 7, eta)
    n = int(plan.n_steps)

    shifted = plan.timesteps.copy()
    shifted[:n] -= 1.0
    with pytest.raises(AssertionError):
        check_parity(sampler, cfg, 7, eta, monkeypatch, plan_override=plan._replace(timesteps=shifted))

    if sampler == "ddim":
        bad = plan._replace(eta=np.float32(0.0))
    elif sampler in ("ddpm", "lcm", "pndm"):
        ab_prev = plan.alpha_bar_prev.copy()
        ab_prev[2] *= 1.0001
        bad = plan._replace(alpha_bar_prev=ab_prev)
    elif sampler == "tcd":  # the intermediate s of step 2 (eta 0.5: not the next timestep)
        mid = plan.alpha_bar_mid.copy()
        mid[2] *= 1.0001
        bad = plan._replace(alpha_bar_mid=mid)
    else:
        sigmas = plan.sigmas.copy()
        sigmas[2] *= 1.0001
        bad = plan._replace(sigmas=sigmas)
    with pytest.raises(AssertionError):
        check_parity(sampler, cfg, 7, eta, monkeypatch, plan_override=bad)


@pytest.mark.parametrize("sampler,timesteps,eta", [
    ("tcd", [800], 1.0),  # Hyper-SD's 1-step LoRA card
    ("lcm", [800], 0.0),  # Hyper-SDXL's 1-step UNet card
    ("tcd", [999, 750, 420, 111], 0.3),  # off the distillation grid: a warning in diffusers, the same steps here
    ("lcm", [979, 639, 259], 0.0),
])
def test_custom_timesteps_match_diffusers(sampler: str, timesteps: list[int], eta: float, monkeypatch) -> None:
    """``make_plan(timesteps=...)`` is ``set_timesteps(timesteps=...)``: the list itself, one step each."""
    cfg = {**BETAS["scaled"], "prediction_type": "epsilon"}
    check_parity(sampler, cfg, len(timesteps), eta, monkeypatch, timesteps=timesteps)
    with pytest.raises(AssertionError):  # sharp: the default schedule for that step count is another
        check_parity(sampler, cfg, len(timesteps), eta, monkeypatch, timesteps=timesteps,
                     plan_override=ours_for(cfg, sampler, len(timesteps), eta)[1])


@pytest.mark.parametrize("cfg", [{}, {"solver_order": 3, "final_sigmas_type": "sigma_min"}], ids=["order2", "order3"])
def test_unipc_corrector_and_b_h_are_checked(cfg: dict[str, Any], monkeypatch) -> None:
    """The parity check sees UniPC's corrector and its B(h): without the corrector, with the other
    B(h), or with one corrector step dropped (a disable_corrector entry), ours leaves diffusers'."""
    import dataclasses

    cfg = {**BETAS["scaled"], "prediction_type": "epsilon", **cfg}
    check_parity("unipc", cfg, 7, 0.0, monkeypatch)
    spec, plan = ours_for(cfg, "unipc", 7)
    assert plan.corrector[1:7].all() and not plan.corrector[0]
    for bad_plan, bad_spec in [
        (plan._replace(corrector=np.zeros_like(plan.corrector)), None),
        (plan._replace(corrector=plan.corrector & (np.arange(len(plan.corrector)) != 4)), None),
        (None, dataclasses.replace(spec, solver_type="bh1")),
    ]:
        with pytest.raises(AssertionError):
            check_parity("unipc", cfg, 7, 0.0, monkeypatch, plan_override=bad_plan, spec_override=bad_spec)


def test_deis_orders_are_checked(monkeypatch) -> None:
    """The parity check sees each DEIS order: a third-order run held at second order, or a
    second-order one held at first, leaves diffusers' trajectory; a plan landing on sigma 0 (as
    dpm++'s do) is not diffusers' schedule."""
    for order in (2, 3):
        cfg = {**BETAS["scaled"], "prediction_type": "epsilon", "solver_order": order}
        check_parity("deis", cfg, 20, 0.0, monkeypatch)
        _, plan = ours_for(cfg, "deis", 20)
        assert plan.order[:20].max() == order  # 20 steps: no wind-down
        lower = plan._replace(order=np.minimum(plan.order, order - 1).astype(np.int32))
        with pytest.raises(AssertionError):
            check_parity("deis", cfg, 20, 0.0, monkeypatch, plan_override=lower)
    sigmas = plan.sigmas.copy()
    sigmas[20] = 0.0
    with pytest.raises(AssertionError):
        check_parity("deis", cfg, 20, 0.0, monkeypatch, plan_override=plan._replace(sigmas=sigmas))


def test_lms_coefficients_are_checked(monkeypatch) -> None:
    """The parity check sees LMS's multistep weights: Euler's (the first derivative alone, over
    the step) or the older derivatives' weights swapped leave diffusers' trajectory."""
    cfg = {**BETAS["scaled"], "prediction_type": "epsilon"}
    check_parity("lms", cfg, 7, 0.0, monkeypatch)
    _, plan = ours_for(cfg, "lms", 7)
    c = plan.lms_coeffs
    np.testing.assert_allclose(c[:7].sum(axis=1), np.diff(plan.sigmas[:8]), rtol=1e-5)  # each integrates 1 over the step
    assert np.count_nonzero(c[:7], axis=1).tolist() == [1, 2, 3, 4, 4, 4, 4]  # min(i + 1, 4) points
    euler = np.zeros_like(c)
    euler[:7, 0] = np.diff(plan.sigmas[:8])
    swapped = c.copy()
    swapped[:, [1, 2]] = c[:, [2, 1]]
    for bad in (euler, swapped):
        with pytest.raises(AssertionError):
            check_parity("lms", cfg, 7, 0.0, monkeypatch, plan_override=plan._replace(lms_coeffs=bad))


@pytest.mark.parametrize("sampler", ["dpm2", "dpm2_a", "dpmpp_sde"])
def test_midpoints_are_checked(sampler: str, monkeypatch) -> None:
    """The parity check sees where the second model call is: its sigma 3e-4 off, or its t one training
    step off, leaves diffusers' trajectory; for dpmpp_sde, so do the two moves' noises drawn as unrelated
    (the second increment of its Brownian path without the first)."""
    from tests._support import sampler_ref

    cfg = {**BETAS["scaled"], "prediction_type": "epsilon"}
    check_parity(sampler, cfg, 7, 0.0, monkeypatch)
    _, plan = ours_for(cfg, sampler, 7)
    off_sigma, off_t = plan.mid_sigmas.copy(), plan.mid_timesteps.copy()
    off_sigma[2] *= 1.0003  # 1e-4 moves dpm2's image by ~8e-5, within the floor of the steps' roundings
    off_t[2] -= 1.0
    for bad in (plan._replace(mid_sigmas=off_sigma), plan._replace(mid_timesteps=off_t)):
        with pytest.raises(AssertionError):
            check_parity(sampler, cfg, 7, 0.0, monkeypatch, plan_override=bad)
    if sampler == "dpmpp_sde":
        monkeypatch.setattr(sampler_ref._TablePath, "independent", True)
        with pytest.raises(AssertionError):
            check_parity(sampler, cfg, 7, 0.0, monkeypatch)


@pytest.mark.parametrize("pred", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("spacing", ["linspace", "trailing"])
def test_dpm2_a_where_diffusers_is_nan(pred: str, spacing: str, monkeypatch) -> None:
    """A cosine schedule's first step, from sigma ~2e4 to ~3.8 (7 steps): KDPM2Ancestral's float32 sigma_down
    (exactly ~7e-4) is sub-ulp rounding noise of ``sigma_next^2 - sigma_up^2`` ~14: 0, whose run is NaN (on the
    project's AMD EPYC), or a negative (NaN) or one-ulp remainder (~1e-3, 35% off), depending on the CPU's torch
    ``pow`` (the grid takes the finite cases, against the float64 run). Ours is diffusers' own code run in
    float64 (its tables too), as
    near as float32 gets there: the second call multiplies the float32 rounding of the first x0, at a sample
    of ~3e4, by sigma / sigma_next ~5000 (measured: 2.0e-4 of the step's largest sample with epsilon, 6.8e-6
    with v_prediction). k-diffusion's float32 rule where sigma_down is 0 (the first call's Euler move onto 0,
    then the noise) is a different image (0.73 to 1.0 of it)."""
    from tests._support.sampler_ref import inject_torch_tables, noise_for, run_diffusers, run_ours

    cfg = _config("cosine", pred, spacing, {})
    theirs = diffusers_scheduler("dpm2_a", cfg)
    theirs.set_timesteps(7)
    s0, s1 = (float(v) for v in theirs.sigmas[:2])
    down = float(theirs.sigmas_down[0])  # float32, cancelled
    assert not 0.9 < down / (s1 * s1 / s0) < 1.1  # NaN, 0 or far off
    inject_torch_tables(monkeypatch)
    spec, plan = ours_for(cfg, "dpm2_a", 7)
    x_t, table = noise_for(7, plan.timesteps.shape[0])
    exact = run_diffusers("dpm2_a", cfg, 7, x_t, table, monkeypatch, float64=True).xs

    def error(ours: list[np.ndarray]) -> float:  # the largest step's error, as a share of that step's largest sample
        return max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(ours, exact))

    _, xs = run_ours(spec, plan, x_t, table)
    euler_first = plan.mid_sigmas.copy()
    euler_first[0] = 0.0
    _, xs_euler = run_ours(spec, plan._replace(mid_sigmas=euler_first), x_t, table)
    assert error(xs) < 1e-3
    assert error(xs_euler) > 1e-2


def test_unipc_bh1_onto_sigma_zero_is_the_finite_limit(monkeypatch) -> None:
    """bh1 with the default final sigma 0: diffusers' last step computes -inf * 0 (NaN) where the
    first-order update has no B(h) term at all; ours matches every earlier step and ends on that
    step's x0 estimate, as bh2 does."""
    from tests._support.sampler_ref import inject_torch_tables, noise_for, run_diffusers, run_ours

    inject_torch_tables(monkeypatch)
    cfg = {**BETAS["scaled"], "prediction_type": "epsilon", "solver_type": "bh1"}
    spec, plan = ours_for(cfg, "unipc", 6)
    x_t, table = noise_for(6, plan.timesteps.shape[0])
    ref = run_diffusers("unipc", cfg, 6, x_t, table, monkeypatch)
    _, xs = run_ours(spec, plan, x_t, table)
    assert np.isnan(ref.xs[-1]).all() and np.isfinite(xs[-1]).all()
    for ours, theirs in zip(xs[:-1], ref.xs[:-1]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    bh2_spec, bh2_plan = ours_for({**cfg, "solver_type": "bh2"}, "unipc", 6)
    assert not np.allclose(run_ours(bh2_spec, bh2_plan, x_t, table)[1][-2], xs[-2], atol=1e-3)  # bh1 is not bh2


@pytest.mark.parametrize("sampler", ["dpmpp_2m_karras", "dpmpp_2m_sde_karras"])
def test_karras_repeated_first_timestep(sampler: str, monkeypatch) -> None:
    """dpm++ Karras on squaredcos_cap_v2 repeats its first (truncated) timestep; diffusers'
    pipeline loop then crashes at the end. We run the intended schedule: it matches diffusers
    started with ``set_begin_index(0)`` (the driver does that)."""
    cfg = {**BETAS["cosine"], "prediction_type": "epsilon"}
    _, plan = ours_for(cfg, sampler, 7)
    assert plan.timesteps[0] == plan.timesteps[1] == 998.0
    check_parity(sampler, cfg, 7, 0.0, monkeypatch)


@pytest.mark.parametrize("via_json", [False, True], ids=["in-memory", "json-file"])
@pytest.mark.parametrize("sampler", ["ddim", "euler", "heun", "dpmpp_2m"])
def test_foreign_config_uses_target_class_defaults(sampler: str, via_json: bool, monkeypatch) -> None:
    """A DDPMScheduler config (clip_sample=True, offset 1, v-prediction) loaded into another
    class: present keys win, absent keys take the target class's defaults. In memory,
    diffusers also treats keys listed in ``_use_default_values`` (here timestep_spacing) as
    absent; a saved JSON file carries them as explicit values."""
    import diffusers

    ddpm = diffusers.DDPMScheduler(
        beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, steps_offset=1,
        clip_sample=True, prediction_type="v_prediction",
    )
    saved = json.loads(ddpm.to_json_string()) if via_json else dict(ddpm.config)
    assert ("_use_default_values" in saved) != via_json
    check_parity(sampler, saved, 9, 0.0, monkeypatch)


def test_lambda_min_clipped(monkeypatch) -> None:
    cfg = {**BETAS["cosine"], "lambda_min_clipped": -5.1, "prediction_type": "v_prediction"}
    _, plan = ours_for(cfg, "dpmpp_2m", 10)
    assert plan.timesteps[0] < 999  # the clipping moved the top of the schedule
    check_parity("dpmpp_2m", cfg, 10, 0.0, monkeypatch)
    check_parity("dpmpp_2m", {**cfg, "timestep_spacing": "trailing"}, 10, 0.0, monkeypatch)


@pytest.mark.parametrize("sampler", ["euler", "heun", "dpmpp_2m_karras", "dpmpp_2m_sde_karras"])
def test_karras_sigma_bounds_from_config(sampler: str, monkeypatch) -> None:
    cfg = {**BETAS["scaled"], "use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0}
    _, plan = ours_for(cfg, sampler, 6)
    assert plan.sigmas[0] == np.float32(10.0)
    check_parity(sampler, cfg, 6, 0.0, monkeypatch)


# Zero terminal SNR (rescale_betas_zero_snr=True, Lin et al. 2024): the samplers whose diffusers class
# reads the key, over every beta schedule x spacing with the step count rotating; v-prediction (what
# zero-SNR models are trained for) everywhere, and epsilon for the sigma-space ones (their classes
# clamp the terminal alphas_cumprod at 2**-24, so it stays defined). Their first step leaves sigma
# ~4096 (a sample ~1e4); euler_a's Euler move there is written without cancellation
# (``_core.euler_move``) and compared with diffusers' float64 run, so the plain criterion holds.
ZERO_SNR_SAMPLERS = tuple(s for s in DIFFUSION_SAMPLERS if "rescale_betas_zero_snr" in CLASS_DEFAULTS[s])
_SIGMA_SPACE = ("euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "unipc", "dpmpp_2m_sde", "dpmpp_2m_sde_karras")


def _zero_snr_cases() -> list[Any]:
    cases = []
    for sampler in ZERO_SNR_SAMPLERS:
        predictions = ("v_prediction", "epsilon") if sampler in _SIGMA_SPACE else ("v_prediction",)
        axes = [list(enumerate(BETAS)), list(enumerate(predictions)), list(enumerate(("trailing", "leading",
                                                                                      "linspace")))]
        for j, ((i, b), (k, p), (m, s)) in enumerate(itertools.product(*axes)):
            n = STEPS[j % len(STEPS)]
            cases.append(pytest.param(sampler, b, p, s, n, id=f"{sampler}-{b}-{p}-{s}-{n}",
                                      marks=covering_marks(i, k, m)))
    return cases


@pytest.mark.parametrize("sampler,beta,pred,spacing,steps", _zero_snr_cases())
def test_zero_terminal_snr_matches_diffusers(sampler: str, beta: str, pred: str, spacing: str, steps: int,
                                             monkeypatch) -> None:
    eta = 0.5 if sampler in ("ddim", "tcd") else 0.0
    cfg = {"_class_name": "SomeScheduler", **BETAS[beta], "prediction_type": pred, **SPACINGS[spacing],
           "rescale_betas_zero_snr": True}
    check_parity(sampler, cfg, steps, eta, monkeypatch)


@pytest.mark.parametrize("sampler", ["ddim", "euler", "dpmpp_2m"])
def test_zero_terminal_snr_is_checked(sampler: str, monkeypatch) -> None:
    """The parity check sees the rescale: the plan of the same config without it fails."""
    cfg = {**BETAS["scaled"], "prediction_type": "v_prediction", "timestep_spacing": "trailing"}
    check_parity(sampler, {**cfg, "rescale_betas_zero_snr": True}, 7, 0.0, monkeypatch)
    plain = ours_for(cfg, sampler, 7)[1]
    with pytest.raises(AssertionError):
        check_parity(sampler, {**cfg, "rescale_betas_zero_snr": True}, 7, 0.0, monkeypatch, plan_override=plain)
