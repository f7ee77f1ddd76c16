"""SchedulerConfig parsing, per-sampler defaults and the errors for what we do not implement."""

from __future__ import annotations

import dataclasses

import inspect
import json
import math
from typing import Any

import numpy as np
import pytest

import diffusers
from preheat.errors import SchedulerConfigError
from preheat.samplers import DIFFUSION_SAMPLERS, SchedulerConfig, make_plan, make_spec
from preheat.samplers._tables import CLASS_DEFAULTS, DIFFUSERS_CLASS, DPM_FIXED_SETTINGS


@pytest.mark.parametrize("sampler", DIFFUSION_SAMPLERS)
def test_class_defaults_match_diffusers_signatures(sampler: str) -> None:
    """Absent keys take the defaults of the diffusers class the sampler maps to."""
    cls = getattr(diffusers, DIFFUSERS_CLASS[sampler])
    params = inspect.signature(cls.__init__).parameters
    checked = 0
    for key, ours in CLASS_DEFAULTS[sampler].items():
        if key in params:
            theirs = params[key].default
            if isinstance(ours, float) and math.isinf(ours):
                assert theirs == ours, key
            else:
                assert theirs == ours, f"{DIFFUSERS_CLASS[sampler]}.{key}: diffusers {theirs!r}, ours {ours!r}"
            checked += 1
        else:  # read through the config only (hasattr), so absent means None
            assert key in ("sigma_min", "sigma_max") and ours is None, key
    assert checked >= 8


def test_what_a_dpm_samplers_name_fixes_is_its_class_settings() -> None:
    """DPM_FIXED_SETTINGS (what both backends run whatever a folder says) names keys of the sampler's class, and
    the plain samplers fix the class's defaults of the keys a folder is checked on (families.text reads an absent
    one as the plain sampler's value)."""
    for sampler, settings in DPM_FIXED_SETTINGS.items():
        params = inspect.signature(getattr(diffusers, DIFFUSERS_CLASS[sampler]).__init__).parameters
        assert set(settings) <= set(params), sampler
        if sampler in ("dpmpp_2m", "dpmpp_2s"):
            for key in ("algorithm_type", "solver_type", "solver_order", "use_karras_sigmas"):
                assert settings[key] == params[key].default, (sampler, key)


def test_from_dict_keeps_present_values_and_drops_the_rest() -> None:
    cfg = SchedulerConfig.from_dict({
        "_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", "skip_prk_steps": True,
        "beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012,
        "num_train_timesteps": 1000, "set_alpha_to_one": False, "steps_offset": 1,
        "trained_betas": None, "clip_sample": False, "solver_order": 3,
    })
    assert cfg.beta_schedule == "scaled_linear" and cfg.steps_offset == 1 and cfg.clip_sample is False
    assert cfg.prediction_type is None  # absent: the sampler's class default applies
    assert cfg.ignored_keys == () and cfg.solver_order == 3  # read by unipc only
    assert cfg.skip_prk_steps is True  # read by sampler "pndm" (it refuses False)
    assert cfg.class_name == "PNDMScheduler"  # decides flow matching vs diffusion (config_kind)
    assert hash(cfg) == hash(SchedulerConfig.from_dict(dict(
        _class_name="PNDMScheduler", beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, num_train_timesteps=1000,
        set_alpha_to_one=False, steps_offset=1, clip_sample=False, skip_prk_steps=True, solver_order=3,
    )))
    assert cfg != dataclasses.replace(cfg, solver_order=2)  # unipc reads it: part of the config


def test_use_default_values_keys_count_as_absent() -> None:
    cfg = SchedulerConfig.from_dict({"timestep_spacing": "leading", "_use_default_values": ["timestep_spacing"]})
    assert cfg.timestep_spacing is None


def test_absent_keys_take_the_sampler_class_default() -> None:
    cfg = SchedulerConfig.from_dict({})
    assert make_spec(cfg, "ddpm").clip_sample is True  # DDPMScheduler: clip_sample=True
    assert make_spec(cfg, "heun").clip_sample is False  # HeunDiscreteScheduler: False
    assert make_spec(cfg, "euler").clip_sample is False  # EulerDiscreteScheduler has no clipping
    assert make_plan(cfg, "ddim", 10).timesteps[0] == 900  # DDIM: "leading"
    assert make_plan(cfg, "euler", 10).timesteps[0] == 999  # Euler: "linspace"
    # Heun's own beta defaults (0.00085, 0.012) differ from the others' (0.0001, 0.02)
    assert make_plan(cfg, "heun", 10).sigmas[0] != make_plan(cfg, "euler", 10).sigmas[0]


def test_sampler_name_decides_karras_for_dpm() -> None:
    cfg = SchedulerConfig.from_dict({"use_karras_sigmas": True})
    plain, karras = make_plan(cfg, "dpmpp_2m", 10), make_plan(cfg, "dpmpp_2m_karras", 10)
    assert not np.array_equal(plain.sigmas, karras.sigmas)
    assert np.array_equal(plain.sigmas, make_plan(SchedulerConfig(), "dpmpp_2m", 10).sigmas)
    assert make_spec(cfg, "dpmpp_2m") == make_spec(cfg, "dpmpp_2m_karras")  # one compiled solver


def test_from_file(tmp_path) -> None:
    sched = diffusers.DDIMScheduler(beta_schedule="squaredcos_cap_v2", prediction_type="v_prediction")
    sched.save_config(tmp_path)
    cfg = SchedulerConfig.from_file(tmp_path / "scheduler_config.json")
    assert cfg.beta_schedule == "squaredcos_cap_v2" and cfg.prediction_type == "v_prediction"
    with pytest.raises(SchedulerConfigError, match="not found"):
        SchedulerConfig.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SchedulerConfigError, match="cannot read"):
        SchedulerConfig.from_file(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(SchedulerConfigError, match="JSON object"):
        SchedulerConfig.from_file(tmp_path / "list.json")


def test_infinite_lambda_min_clipped_from_json() -> None:
    cfg = SchedulerConfig.from_dict(json.loads('{"lambda_min_clipped": -Infinity}'))
    assert cfg.lambda_min_clipped == -math.inf
    make_plan(cfg, "dpmpp_2m", 10)


# (config dict, sampler, the field the one-line message must name)
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"beta_schedule": "sigmoid"}, "ddpm", "beta_schedule"),
    ({"beta_schedule": "exp"}, "heun", "beta_schedule"),
    ({"prediction_type": "flow_prediction"}, "dpmpp_2m", "prediction_type"),
    ({"timestep_spacing": "karras"}, "euler", "timestep_spacing"),
    ({"trained_betas": [0.1, 0.2]}, "ddim", "trained_betas"),
    ({"thresholding": True}, "ddpm", "thresholding"),
    ({"thresholding": True}, "ddim", "thresholding"),
    ({"thresholding": True}, "dpmpp_2m", "thresholding"),
    # zero terminal SNR reached with a noise prediction (diffusers' NaN); zero-SNR models predict v
    ({"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"}, "ddim", "rescale_betas_zero_snr"),
    ({"rescale_betas_zero_snr": True}, "lcm", "rescale_betas_zero_snr"),
    ({"use_exponential_sigmas": True}, "euler", "use_exponential_sigmas"),
    ({"use_beta_sigmas": True}, "heun", "use_beta_sigmas"),
    ({"use_lu_lambdas": True}, "dpmpp_2m_karras", "use_lu_lambdas"),
    ({"use_flow_sigmas": True}, "dpmpp_2m", "use_flow_sigmas"),
    ({"final_sigmas_type": "sigma_min"}, "dpmpp_2m", "final_sigmas_type"),
    ({"final_sigmas_type": "sigma_min"}, "euler", "final_sigmas_type"),
    ({"interpolation_type": "log_linear"}, "euler", "interpolation_type"),
    ({"timestep_type": "continuous", "prediction_type": "v_prediction"}, "euler", "timestep_type"),
    ({"variance_type": "learned_range"}, "ddpm", "variance_type"),
    ({"variance_type": "fixed_large_log"}, "ddpm", "variance_type"),
    ({"variance_type": "learned_range"}, "dpmpp_2m", "variance_type"),
    ({"num_train_timesteps": "1000"}, "ddpm", "num_train_timesteps"),
    ({"num_train_timesteps": 1}, "ddpm", "num_train_timesteps"),
    ({"clip_sample": "yes"}, "ddpm", "clip_sample"),
    ({"beta_end": 1.5}, "euler", "beta_end"),
    ({"steps_offset": -1}, "ddim", "steps_offset"),
    ({"clip_sample_range": 0.0}, "ddpm", "clip_sample_range"),
    ({"sigma_min": float("nan")}, "euler", "sigma_min"),
    ({"thresholding": True}, "unipc", "thresholding"),
    ({"predict_x0": False}, "unipc", "predict_x0"),
    ({"solver_order": 4}, "unipc", "solver_order"),
    ({"solver_order": 0}, "unipc", "solver_order"),
    ({"solver_type": "bh3"}, "unipc", "solver_type"),
    ({"lower_order_final": False}, "unipc", "lower_order_final"),  # onto sigma 0: diffusers' inf
    ({"final_sigmas_type": "sigma_min", "use_karras_sigmas": True}, "unipc", "final_sigmas_type"),
    ({"final_sigmas_type": "sigma_max"}, "unipc", "final_sigmas_type"),
    ({"use_flow_sigmas": True}, "unipc", "use_flow_sigmas"),
    ({"use_exponential_sigmas": True}, "unipc", "use_exponential_sigmas"),
    ({"disable_corrector": [1.5]}, "unipc", "disable_corrector"),
    ({"disable_corrector": 2}, "unipc", "disable_corrector"),
    ({"thresholding": True}, "dpmpp_2m_sde", "thresholding"),
    ({"final_sigmas_type": "sigma_min"}, "dpmpp_2m_sde_karras", "final_sigmas_type"),
    ({"variance_type": "learned"}, "dpmpp_2m_sde", "variance_type"),
    ({"skip_prk_steps": False}, "pndm", "skip_prk_steps"),  # the Runge-Kutta warm-up: not implemented
    ({"prediction_type": "sample"}, "pndm", "prediction_type"),  # PNDMScheduler raises on it too
    ({"skip_prk_steps": 1}, "pndm", "skip_prk_steps"),
]


@pytest.mark.parametrize("d,sampler,field", REFUSED, ids=[f"{s}-{f}" for _, s, f in REFUSED])
def test_unsupported_values_are_refused(d: dict[str, Any], sampler: str, field: str) -> None:
    with pytest.raises(SchedulerConfigError) as info:
        make_plan(SchedulerConfig.from_dict(d), sampler, 10)
    msg = str(info.value)
    assert field in msg and "\n" not in msg
    assert isinstance(info.value, ValueError)


# values a class does not read are ignored, as diffusers' from_config does
IGNORED: list[tuple[dict[str, Any], str]] = [
    ({"thresholding": True}, "euler"),
    ({"rescale_betas_zero_snr": True}, "heun"),
    ({"final_sigmas_type": "sigma_min"}, "heun"),
    ({"interpolation_type": "log_linear"}, "dpmpp_2m"),
    ({"variance_type": "fixed_small"}, "dpmpp_2m"),  # only learned variances matter to dpm++
    ({"variance_type": "learned_range"}, "ddim"),
    ({"use_exponential_sigmas": True}, "ddpm"),
    ({"timestep_type": "continuous", "prediction_type": "epsilon"}, "euler"),  # no effect without v
    ({"algorithm_type": "sde-dpmsolver++", "solver_order": 3}, "dpmpp_2m"),  # the name decides
    ({"solver_type": "bh1", "disable_corrector": [0], "lower_order_final": False}, "dpmpp_2m"),  # UniPC's keys
    ({"lambda_min_clipped": -5.1, "algorithm_type": "dpmsolver"}, "unipc"),  # dpm++'s keys
    ({"algorithm_type": "dpmsolver++", "solver_type": "heun"}, "dpmpp_2m_sde"),  # ... both ways
    ({"skip_prk_steps": False}, "ddim"),  # only pndm reads it
    ({"thresholding": True, "clip_sample": True}, "pndm"),  # PNDMScheduler has neither
]


@pytest.mark.parametrize("d,sampler", IGNORED, ids=[s + "-" + next(iter(d)) for d, s in IGNORED])
def test_values_the_class_does_not_read_are_ignored(d: dict[str, Any], sampler: str) -> None:
    cfg = SchedulerConfig.from_dict(d)
    for ours, plain in zip(make_plan(cfg, sampler, 10), make_plan(SchedulerConfig(), sampler, 10)):
        assert np.array_equal(ours, plain)
    assert make_spec(cfg, sampler) == make_spec(SchedulerConfig(), sampler)


def test_unknown_sampler() -> None:
    with pytest.raises(SchedulerConfigError, match="unknown sampler 'dpm_sde'.*euler_a"):
        make_plan(SchedulerConfig(), "dpm_sde", 10)
    with pytest.raises(SchedulerConfigError, match="unknown sampler"):
        make_spec(SchedulerConfig(), "Euler")


@pytest.mark.parametrize("steps", [0, -3, 1001, 2.5, True, "10"])
def test_bad_step_counts(steps: Any) -> None:
    with pytest.raises(SchedulerConfigError, match="steps"):
        make_plan(SchedulerConfig(), "euler", steps)


def test_step_count_edges() -> None:
    cfg = SchedulerConfig()
    for sampler in ("ddpm", "ddim", "euler", "heun"):
        assert int(make_plan(cfg, sampler, 1000).n_steps) == 1000
    # dpm++ spaces steps + 1 points: 1000 steps repeat a timestep (zero-length steps)
    with pytest.raises(SchedulerConfigError, match="steps=1000.*do not strictly decrease"):
        make_plan(cfg, "dpmpp_2m", 1000)
    # leading spacing + offset 1 at 1000 steps reaches t = 1000 (diffusers: IndexError)
    with pytest.raises(SchedulerConfigError, match="steps=1000.*steps_offset=1.*1000"):
        make_plan(SchedulerConfig(steps_offset=1), "ddim", 1000)
    # diffusers' trailing spacing makes a 62nd timestep, -1, for 61 steps (it would index t=-1)
    with pytest.raises(SchedulerConfigError, match="steps=61.*trailing.*-1"):
        make_plan(SchedulerConfig(timestep_spacing="trailing"), "ddim", 61)
    # ... but with Karras sigmas that spacing only picks the end points: fine, as in diffusers
    make_plan(SchedulerConfig(timestep_spacing="trailing", use_karras_sigmas=True), "euler", 61)


def test_eta() -> None:
    cfg = SchedulerConfig()
    assert float(make_plan(cfg, "ddim", 10, eta=0.5).eta) == 0.5
    assert float(make_plan(cfg, "tcd", 10, eta=1.0).eta) == 1.0  # TCD's gamma
    with pytest.raises(SchedulerConfigError, match="eta=0.5 is only supported for sampler 'ddim' or 'tcd'; use eta=0.0 for sampler 'euler'"):
        make_plan(cfg, "euler", 10, eta=0.5)
    for sampler in ("ddim", "tcd"):
        with pytest.raises(SchedulerConfigError, match="eta"):
            make_plan(cfg, sampler, 10, eta=1.5)


def test_custom_timesteps_bad_input_is_one_line() -> None:
    cfg = SchedulerConfig()
    assert make_plan(cfg, "tcd", 2, timesteps=[800, 400]).timesteps[:2].tolist() == [800.0, 400.0]
    for sampler, steps, timesteps, text in [
        ("euler", 1, [800], "timesteps is not supported for sampler 'euler'; only lcm, tcd take it"),
        ("tcd", 2, [800], "timesteps has 1 entries but steps=2; pass steps=1"),
        ("tcd", 2, [400, 800], "must strictly decrease within \\[0, 999\\]"),
        ("lcm", 1, [1000], "must strictly decrease within"),
        ("lcm", 1, [-1], "must strictly decrease within"),
        ("tcd", 1, [8.5], "must be a list of ints"),
    ]:
        with pytest.raises(SchedulerConfigError, match=text) as e:
            make_plan(cfg, sampler, steps, timesteps=timesteps)
        assert e.value.argument == "timesteps" and "\n" not in str(e.value)


def test_overrides_are_from_config_with_keys() -> None:
    """``with_overrides``: a card's ``Class.from_config(config, timestep_spacing="trailing")``; the
    folder's other keys stay, a value is checked like the file's, and a key the sampler's class
    does not read (or whose schedule ignores it) is one line naming it."""
    from preheat.samplers import with_overrides

    folder = SchedulerConfig.from_dict({"_class_name": "PNDMScheduler", "beta_schedule": "scaled_linear",
                                        "beta_start": 0.00085, "beta_end": 0.012, "steps_offset": 1,
                                        "timestep_spacing": "leading"})
    trailing = with_overrides(folder, "euler", {"timestep_spacing": "trailing"})
    assert trailing.timestep_spacing == "trailing" and trailing.beta_schedule == "scaled_linear"
    assert with_overrides(folder, "euler", {}) is folder
    expect = make_plan(SchedulerConfig.from_dict({**{k: getattr(folder, k) for k in ("beta_schedule", "beta_start",
                                                                                    "beta_end", "steps_offset")},
                                                  "timestep_spacing": "trailing"}), "euler", 4)
    assert np.array_equal(make_plan(trailing, "euler", 4).timesteps, expect.timesteps)
    assert not np.array_equal(make_plan(folder, "euler", 4).timesteps, expect.timesteps)
    with pytest.raises(SchedulerConfigError, match="timestep_spacing='sideways' is not supported"):
        with_overrides(folder, "ddim", {"timestep_spacing": "sideways"})
    for sampler in ("lcm", "tcd", "dpmpp_2s"):  # (DPMSolverSinglestepScheduler does not even take the key)
        with pytest.raises(SchedulerConfigError, match=f"timestep_spacing does not apply to sampler '{sampler}'") as e:
            with_overrides(folder, sampler, {"timestep_spacing": "trailing"})
        assert e.value.argument == "timestep_spacing" and "\n" not in str(e.value)
    with pytest.raises(SchedulerConfigError, match="shift does not apply to sampler 'euler'"):
        with_overrides(folder, "euler", {"shift": 3.0})


def test_karras_bounds_must_decrease() -> None:
    with pytest.raises(SchedulerConfigError, match="do not strictly decrease.*sigma_min"):
        make_plan(SchedulerConfig(use_karras_sigmas=True, sigma_min=5.0, sigma_max=1.0), "euler", 10)
