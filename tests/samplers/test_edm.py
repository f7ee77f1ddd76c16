"""EDM samplers (EDMEulerScheduler, EDMDPMSolverMultistepScheduler) against diffusers.

The schedules are torch's float32 arithmetic, and torch's float32 ``pow``/``exp``/``log`` are not
correctly rounded where ours are: sigmas and ``c_noise`` are checked within 1 ulp (and how rarely
they differ is measured below); the trajectories by ``sampler_ref.check_parity``'s criterion, the
same as every other sampler's (test_sampler_parity explains it).
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from typing import Any

import numpy as np
import pytest

import diffusers
from preheat.errors import SchedulerConfigError
from preheat.samplers import (EDM_SAMPLERS, SchedulerConfig, config_kind, make_plan, make_spec, samplers_of_kind,
                              with_overrides)
from preheat.samplers import _schedules as S
from preheat.samplers._tables import CLASS_DEFAULTS, DIFFUSERS_CLASS
from tests._support.numerics import assert_within_ulps, ulp_distance
from tests._support.sampler_ref import assert_c_noise_close, check_parity, ours_for
from tests._support.tiers import covering_marks

SCHEDULES = ("karras", "exponential")
PREDICTIONS = ("epsilon", "v_prediction")
SIGMA_DATA = (0.5, 1.0)  # Playground v2.5's, CosXL's
STEPS = (1, 7, 20)
# Settings beyond the class defaults, each crossed with the base axes (the step count rotating).
EXTRAS: dict[str, list[dict[str, Any]]] = {
    "edm_euler": [{"final_sigmas_type": "sigma_min"}, {"sigma_min": 0.03, "sigma_max": 14.6, "rho": 5.0}],
    "edm_dpmpp_2m": [{"solver_order": 1}, {"solver_type": "heun"},
                     {"lower_order_final": False, "final_sigmas_type": "sigma_min"},
                     {"euler_at_final": True, "final_sigmas_type": "sigma_min"},
                     {"sigma_min": 0.03, "sigma_max": 120.0, "rho": 5.0}],
    "edm_dpmpp_2m_sde": [{"solver_type": "heun"}, {"final_sigmas_type": "sigma_min"}],
}


def _cfg(sampler: str, schedule: str, pred: str, sigma_data: float, **extra: Any) -> dict[str, Any]:
    return {"_class_name": DIFFUSERS_CLASS[sampler], "sigma_schedule": schedule, "prediction_type": pred,
            "sigma_data": sigma_data, **extra}


def _cases() -> list[Any]:
    """Every sampler and extra over schedule x prediction x sigma_data x steps; ``make test`` runs the
    third in which every two axis values meet (``covering_marks``: the 3 step counts complete it)."""
    cases = []
    axes = [list(enumerate(SCHEDULES)), list(enumerate(PREDICTIONS)), list(enumerate(SIGMA_DATA)),
            list(enumerate(STEPS))]
    for sampler in EDM_SAMPLERS:
        for extra in [{}, *EXTRAS[sampler]]:
            tag = ",".join(f"{k}={v}" for k, v in extra.items())
            for (i, sched), (k, pred), (m, sd), (q, steps) in itertools.product(*axes):
                cases.append(pytest.param(sampler, sched, pred, sd, steps, extra,
                                          id=f"{sampler}-{sched}-{pred}-{sd}-{steps}" + (f"-{tag}" if tag else ""),
                                          marks=covering_marks(i, k, m, q)))
    return cases


@pytest.mark.parametrize("sampler,schedule,pred,sigma_data,steps,extra", _cases())
def test_matches_diffusers(sampler: str, schedule: str, pred: str, sigma_data: float, steps: int,
                           extra: dict[str, Any], monkeypatch) -> None:
    check_parity(sampler, _cfg(sampler, schedule, pred, sigma_data, **extra), steps, 0.0, monkeypatch)


@pytest.mark.parametrize("sampler", EDM_SAMPLERS)
def test_negative_controls(sampler: str, monkeypatch) -> None:
    """The check is sharp: it fails for c_noise off by 1, a sigma 1e-4 off, another sigma_data, and
    (dpm++) a plan held at first order or the other second-order term."""
    import dataclasses

    cfg = _cfg(sampler, "karras", "epsilon", 0.5)
    check_parity(sampler, cfg, 20, 0.0, monkeypatch)
    spec, plan = ours_for(cfg, sampler, 20)
    shifted = plan.timesteps.copy()
    shifted[:20] -= 1.0
    sigmas = plan.sigmas.copy()
    sigmas[2] *= 1.0001
    bad = [(plan._replace(timesteps=shifted), None), (plan._replace(sigmas=sigmas), None),
           (None, dataclasses.replace(spec, sigma_data=0.6))]
    if sampler != "edm_euler":
        bad += [(plan._replace(order=np.ones_like(plan.order)), None),
                (None, dataclasses.replace(spec, solver_type="heun"))]
    for bad_plan, bad_spec in bad:
        with pytest.raises(AssertionError):
            check_parity(sampler, cfg, 20, 0.0, monkeypatch, plan_override=bad_plan, spec_override=bad_spec)


@pytest.mark.parametrize("cls_name,float32_ramp", [("EDMEulerScheduler", False),
                                                   ("EDMDPMSolverMultistepScheduler", True)])
def test_schedules_are_within_an_ulp_of_diffusers(cls_name: str, float32_ramp: bool) -> None:
    """Sigmas and c_noise within 1 ulp of torch's at every step count tried (torch's float32 pow / exp /
    log against correctly rounded ones: ~1% of sigmas, ~5% of c_noise on this project's AMD EPYC);
    exact where no torch kernel is involved: a final sigma of 0 or the config's sigma_min, and
    init_noise_sigma."""
    cls = getattr(diffusers, cls_name)
    sampler = "edm_euler" if cls_name == "EDMEulerScheduler" else "edm_dpmpp_2m"
    total = off = 0
    for schedule, (lo, hi, rho), final in itertools.product(
            SCHEDULES, [(0.002, 80.0, 7.0), (0.002, 120.0, 7.0), (0.03, 14.6, 5.0)], ("zero", "sigma_min")):
        cfg = {"sigma_min": lo, "sigma_max": hi, "rho": rho, "sigma_schedule": schedule, "final_sigmas_type": final}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = cls.from_config(cfg)
        for steps in (*range(1, 31), 50, 257, 999):
            theirs.set_timesteps(steps)
            plan = make_plan(SchedulerConfig.from_dict({"_class_name": cls_name, **cfg}), sampler, steps)
            ref_sigmas = theirs.sigmas.numpy()
            assert_within_ulps(plan.sigmas[: steps + 1], ref_sigmas, 1, f"{cls_name} sigmas, {steps} steps")
            assert_within_ulps(S.edm_noise(ref_sigmas[:steps]), theirs.timesteps.numpy(), 1, f"{cls_name} c_noise")
            assert_c_noise_close(plan.timesteps[:steps], theirs.timesteps.numpy())
            if final == "zero" or float32_ramp:  # 0, or the config's sigma_min: no torch kernel in between
                assert plan.sigmas[steps] == ref_sigmas[-1]
            assert np.float32(plan.init_noise_sigma) == np.float32(theirs.init_noise_sigma)  # Python floats
            total += steps
            off += int(np.count_nonzero(ulp_distance(plan.sigmas[:steps], ref_sigmas[:steps])))
    # how often torch's kernels land an ulp away depends on the CPU's (so it is printed, not bounded)
    print(f"{cls_name}: {off} of {total} sigmas 1 ulp from torch's")
    # the float32 ramp is a real property: the float64 one misses EDMDPMSolverMultistepScheduler's sigmas
    sig64 = S.edm_sigmas("karras", 0.002, 80.0, 7.0, 999, float32_ramp=not float32_ramp)
    ref = cls(sigma_min=0.002, sigma_max=80.0)
    ref.set_timesteps(999)
    assert np.max(ulp_distance(sig64, ref.sigmas.numpy()[:999])) > 1


@pytest.mark.parametrize("sampler", EDM_SAMPLERS)
def test_class_defaults_match_diffusers_signatures(sampler: str) -> None:
    params = inspect.signature(getattr(diffusers, DIFFUSERS_CLASS[sampler]).__init__).parameters
    for key, value in CLASS_DEFAULTS[sampler].items():
        assert params[key].default == value, f"{DIFFUSERS_CLASS[sampler]}.{key}"
    # every key of the class is known, but what only thresholding (refused) reads and the name's algorithm
    assert set(params) - {"self", "dynamic_thresholding_ratio", "sample_max_value", "algorithm_type"} \
        <= set(CLASS_DEFAULTS[sampler])


@pytest.mark.parametrize("d,kind", [
    ({"_class_name": "EDMEulerScheduler"}, "edm"),
    ({"_class_name": "EDMDPMSolverMultistepScheduler", "prediction_type": "v_prediction"}, "edm"),
    ({"sigma_data": 0.5, "prediction_type": "epsilon", "final_sigmas_type": "zero"}, "edm"),
    ({"sigma_schedule": "exponential", "solver_order": 2}, "edm"),
    ({"prediction_type": "epsilon", "final_sigmas_type": "zero"}, "diffusion"),
    ({"sigma_min": 0.002, "sigma_max": 80.0}, None),
])
def test_config_kind(d: dict[str, Any], kind: str | None) -> None:
    config = SchedulerConfig.from_dict(d)
    assert config_kind(config) == kind
    assert set(EDM_SAMPLERS) <= set(samplers_of_kind(config)) or kind == "diffusion"
    assert (set(samplers_of_kind(config)) == set(EDM_SAMPLERS)) == (kind == "edm")


@pytest.mark.parametrize("d,sampler,overrides,message", [
    ({"sigma_data": 0.5, "beta_schedule": "linear"}, "edm_euler", {},
     "mixes diffusion keys (beta_schedule) with EDM keys (sigma_data)"),
    ({"_class_name": "EDMEulerScheduler"}, "euler", {}, "sampler 'euler' is for diffusion models, but the scheduler "
     "config is EDM (EDMEulerScheduler); supported: edm_euler, edm_dpmpp_2m, edm_dpmpp_2m_sde"),
    ({"_class_name": "EulerDiscreteScheduler"}, "edm_euler", {}, "sampler 'edm_euler' is for EDM models"),
    ({"_class_name": "EDMEulerScheduler", "prediction_type": "sample"}, "edm_euler", {},
     "prediction_type='sample' is not supported for sampler 'edm_euler'"),
    ({"_class_name": "EDMDPMSolverMultistepScheduler", "solver_order": 3}, "edm_dpmpp_2m", {},
     "solver_order=3 is not supported for sampler 'edm_dpmpp_2m' (EDMDPMSolverMultistepScheduler); supported: 1, 2"),
    ({"_class_name": "EDMDPMSolverMultistepScheduler", "thresholding": True}, "edm_dpmpp_2m_sde", {},
     "thresholding=True is not supported"),
    ({"_class_name": "EDMEulerScheduler", "sigma_min": 80.0, "sigma_max": 0.002}, "edm_euler", {},
     "they must satisfy 0 < sigma_min < sigma_max"),
    ({"_class_name": "EDMEulerScheduler", "sigma_schedule": "linear"}, "edm_euler", {},
     "sigma_schedule='linear' is not supported; supported: 'karras', 'exponential'"),
    ({"_class_name": "EDMEulerScheduler", "sigma_data": 0}, "edm_euler", {}, "sigma_data=0.0 is not supported"),
    ({"_class_name": "EDMDPMSolverMultistepScheduler", "sigma_schedule": "exponential", "sigma_min": 0.03,
      "sigma_max": 14.6, "final_sigmas_type": "sigma_min", "lower_order_final": False, "solver_type": "heun"},
     "edm_dpmpp_2m", {}, "ends on a step that does not move"),
    ({"_class_name": "EDMEulerScheduler"}, "edm_euler", {"timestep_spacing": "trailing"},
     "timestep_spacing does not apply to sampler 'edm_euler': EDMEulerScheduler does not read it"),
    ({"_class_name": "EDMEulerScheduler"}, "edm_euler", {"solver_order": 1},
     "solver_order does not apply to sampler 'edm_euler'"),
])
def test_what_we_do_not_do_is_one_line(d: dict[str, Any], sampler: str, overrides: dict[str, Any],
                                      message: str) -> None:
    with pytest.raises(SchedulerConfigError) as info:
        config = with_overrides(SchedulerConfig.from_dict(d), sampler, overrides)
        make_spec(config, sampler)
        make_plan(config, sampler, 10)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_overrides_and_solver_settings_reach_the_plan() -> None:
    """A card's override of an EDM-DPM key is that class's ``from_config(config, key=value)``; the
    orders are diffusers': first order at the start and (onto sigma 0, or under 15 steps with
    lower_order_final) at the end."""
    config = SchedulerConfig.from_dict({"_class_name": "EDMDPMSolverMultistepScheduler"})
    assert list(make_plan(config, "edm_dpmpp_2m", 5).order[:5]) == [1, 2, 2, 2, 1]
    one = with_overrides(config, "edm_dpmpp_2m", {"solver_order": 1})
    assert list(make_plan(one, "edm_dpmpp_2m", 5).order[:5]) == [1] * 5
    held = with_overrides(config, "edm_dpmpp_2m", {"final_sigmas_type": "sigma_min", "lower_order_final": False})
    plan = make_plan(held, "edm_dpmpp_2m", 5)
    assert list(plan.order[:5]) == [1, 2, 2, 2, 2] and plan.sigmas[5] == np.float32(0.002)
    assert make_spec(with_overrides(config, "edm_dpmpp_2m", {"solver_type": "heun"}), "edm_dpmpp_2m").solver_type \
        == "heun"
    spec = make_spec(SchedulerConfig.from_dict({"_class_name": "EDMEulerScheduler", "sigma_data": 1.0}), "edm_euler")
    assert (spec.solver, spec.sigma_data, spec.noise_draws_per_step) == ("euler", 1.0, 0)
    assert make_spec(config, "edm_dpmpp_2m_sde").noise_draws_per_step == 1
    assert math.isclose(float(make_plan(config, "edm_euler", 3).init_noise_sigma), math.sqrt(80.0 ** 2 + 1),
                        rel_tol=1e-7)
