"""What each sampler reproduces: its diffusers class, the config keys that class reads with their
defaults, and the type of every key -- the tables that ``preheat.samplers._config`` parses configs
and resolves them against (tests/samplers checks them against the installed diffusers).
"""

from __future__ import annotations

import math
from typing import Any

DIFFUSION_SAMPLERS: tuple[str, ...] = (
    "ddpm",
    "ddim",
    "euler",
    "euler_a",
    "heun",
    "dpmpp_2m",
    "dpmpp_2m_karras",
    "lcm",
    "tcd",
    "unipc",
    "dpmpp_2m_sde",
    "dpmpp_2m_sde_karras",
    "pndm",
    "deis",
    "lms",
    "dpm2",
    "dpm2_a",
    "dpmpp_sde",
    "dpmpp_2s",
    "dpmpp_2s_karras",
)
# Samplers for flow-matching models (the model predicts the velocity ``noise - x0``).
FLOW_SAMPLERS: tuple[str, ...] = ("flow_euler", "flow_heun")
# Samplers for models trained with EDM's preconditioning (Karras et al. 2022: Playground v2.5, CosXL):
# continuous noise levels, the model fed ``c_in x`` at ``c_noise = log(sigma) / 4``.
EDM_SAMPLERS: tuple[str, ...] = ("edm_euler", "edm_dpmpp_2m", "edm_dpmpp_2m_sde")
SAMPLERS: tuple[str, ...] = DIFFUSION_SAMPLERS + FLOW_SAMPLERS + EDM_SAMPLERS
# Diffusion samplers that draw no noise per step (ddim given eta=0), so that two backends given the
# same initial noise agree image for image (the torch backend's and bench compare's comparisons).
DETERMINISTIC_SAMPLERS: tuple[str, ...] = ("ddim", "euler", "heun", "dpmpp_2m", "dpmpp_2m_karras", "unipc", "pndm",
                                           "deis", "lms", "dpm2", "dpmpp_2s", "dpmpp_2s_karras", *FLOW_SAMPLERS,
                                           "edm_euler", "edm_dpmpp_2m")

# The diffusers class each sampler reproduces (named in error messages).
DIFFUSERS_CLASS: dict[str, str] = {
    "ddpm": "DDPMScheduler",
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "heun": "HeunDiscreteScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler",
    "dpmpp_2m_karras": "DPMSolverMultistepScheduler",
    "lcm": "LCMScheduler",
    "tcd": "TCDScheduler",
    "unipc": "UniPCMultistepScheduler",
    "dpmpp_2m_sde": "DPMSolverMultistepScheduler",
    "dpmpp_2m_sde_karras": "DPMSolverMultistepScheduler",
    "pndm": "PNDMScheduler",
    "deis": "DEISMultistepScheduler",
    "lms": "LMSDiscreteScheduler",
    "dpm2": "KDPM2DiscreteScheduler",
    "dpm2_a": "KDPM2AncestralDiscreteScheduler",
    "dpmpp_sde": "DPMSolverSDEScheduler",
    "dpmpp_2s": "DPMSolverSinglestepScheduler",
    "dpmpp_2s_karras": "DPMSolverSinglestepScheduler",
    "flow_euler": "FlowMatchEulerDiscreteScheduler",
    "flow_heun": "FlowMatchHeunDiscreteScheduler",
    "edm_euler": "EDMEulerScheduler",
    "edm_dpmpp_2m": "EDMDPMSolverMultistepScheduler",
    "edm_dpmpp_2m_sde": "EDMDPMSolverMultistepScheduler",
}

# What a DPM-Solver sampler's name fixes, whatever a config says: the settings of its diffusers class
# (DIFFUSERS_CLASS) that run its solver. The resolver reads none of these keys for these samplers
# (_config); the torch backend forces them on diffusers' scheduler, so both backends run one solver;
# families.text picks a folder's sampler among its class's by algorithm_type and use_karras_sigmas, and
# refuses a folder whose algorithm_type, solver_type or solver_order none of them fixes (an absent key
# is the class's default, which its plain sampler, dpmpp_2m or dpmpp_2s, fixes; tests/samplers checks).
_FIXED_2S: dict[str, Any] = {"algorithm_type": "dpmsolver++", "solver_order": 2, "solver_type": "midpoint",
                             "lower_order_final": True, "use_karras_sigmas": False}
_FIXED_2M: dict[str, Any] = {**_FIXED_2S, "euler_at_final": False}  # (a multistep class's key only)
DPM_FIXED_SETTINGS: dict[str, dict[str, Any]] = {
    "dpmpp_2m": _FIXED_2M,
    "dpmpp_2m_karras": {**_FIXED_2M, "use_karras_sigmas": True},
    "dpmpp_2m_sde": {**_FIXED_2M, "algorithm_type": "sde-dpmsolver++"},
    "dpmpp_2m_sde_karras": {**_FIXED_2M, "algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True},
    "dpmpp_2s": _FIXED_2S,
    "dpmpp_2s_karras": {**_FIXED_2S, "use_karras_sigmas": True},
}

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
TIMESTEP_SPACINGS = ("leading", "linspace", "trailing")
DDPM_VARIANCE_TYPES = ("fixed_small", "fixed_small_log", "fixed_large")
TIME_SHIFT_TYPES = ("exponential", "linear")
SIGMA_SCHEDULES = ("karras", "exponential")  # EDM*Scheduler

# Defaults of the diffusers class behind each sampler, for every key that class reads and
# that changes the math (keys we refuse included, so that their defaults are known).
# tests/samplers checks these against the installed diffusers signatures.
_COMMON: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "trained_betas": None,
    "prediction_type": "epsilon",
    "steps_offset": 0,
}
_DPM: dict[str, Any] = {
    **_COMMON,
    "timestep_spacing": "linspace",
    "thresholding": False,
    "variance_type": None,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "use_lu_lambdas": False,
    "use_flow_sigmas": False,
    "final_sigmas_type": "zero",
    "lambda_min_clipped": -math.inf,
    "rescale_betas_zero_snr": False,
    # Not __init__ parameters of DPMSolverMultistepScheduler, but its Karras conversion
    # reads them from the config when a foreign (Euler) config carries them.
    "sigma_min": None,
    "sigma_max": None,
}
_DPM_2S: dict[str, Any] = {k: v for k, v in _DPM.items()
                           if k not in ("timestep_spacing", "steps_offset", "rescale_betas_zero_snr", "use_lu_lambdas")}
# the two-call samplers' shared keys (HeunDiscrete, KDPM2Discrete, KDPM2AncestralDiscrete, DPMSolverSDE; Heun
# adds its clipping)
_TWO_CALL: dict[str, Any] = {
    **_COMMON,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "timestep_spacing": "linspace",
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    # read through the config by the Karras conversion, as for dpm++
    "sigma_min": None,
    "sigma_max": None,
}
_EDM: dict[str, Any] = {
    "sigma_min": 0.002,
    "sigma_max": 80.0,
    "sigma_data": 0.5,
    "sigma_schedule": "karras",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "rho": 7.0,
    "final_sigmas_type": "zero",
}
# EDMDPMSolverMultistepScheduler: solver_order (1, 2), solver_type, lower_order_final and euler_at_final
# are read from the config (the class's own keys, as unipc's); algorithm_type is the sampler's name
_EDM_DPM: dict[str, Any] = {
    **_EDM,
    "solver_order": 2,
    "thresholding": False,
    "solver_type": "midpoint",
    "lower_order_final": True,
    "euler_at_final": False,
}
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "ddpm": {
        **_COMMON,
        "timestep_spacing": "leading",
        "clip_sample": True,
        "clip_sample_range": 1.0,
        "variance_type": "fixed_small",
        "thresholding": False,
        "rescale_betas_zero_snr": False,
    },
    "ddim": {
        **_COMMON,
        "timestep_spacing": "leading",
        "clip_sample": True,
        "clip_sample_range": 1.0,
        "set_alpha_to_one": True,
        "thresholding": False,
        "rescale_betas_zero_snr": False,
    },
    "euler": {
        **_COMMON,
        "timestep_spacing": "linspace",
        "interpolation_type": "linear",
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "sigma_min": None,
        "sigma_max": None,
        "timestep_type": "discrete",
        "final_sigmas_type": "zero",
        "rescale_betas_zero_snr": False,
    },
    "euler_a": {
        **_COMMON,
        "timestep_spacing": "linspace",
        "rescale_betas_zero_snr": False,
    },
    "heun": {**_TWO_CALL, "clip_sample": False, "clip_sample_range": 1.0},
    "dpmpp_2m": _DPM,
    "dpmpp_2m_karras": _DPM,
    "dpmpp_2m_sde": _DPM,  # algorithm_type="sde-dpmsolver++": the name decides, as for dpmpp_2m
    "dpmpp_2m_sde_karras": _DPM,
    # PLMS: the name fixes skip_prk_steps=True (the class default is False, the Runge-Kutta
    # warm-up, which we do not implement: an explicit False is refused, see _config.resolve)
    "pndm": {
        **_COMMON,
        "timestep_spacing": "leading",
        "set_alpha_to_one": False,
    },
    # latent consistency models (and LCM-LoRAs): the timesteps are a subset of a fixed
    # original_inference_steps grid, whatever timestep_spacing / steps_offset say (not read)
    "lcm": {
        **_COMMON,
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "timestep_spacing": "leading",
        "original_inference_steps": 50,
        "clip_sample": False,
        "clip_sample_range": 1.0,
        "set_alpha_to_one": True,
        "thresholding": False,
        "timestep_scaling": 10.0,
        "rescale_betas_zero_snr": False,
    },
    # trajectory consistency distillation (TCD LoRAs, Hyper-SD's 1-step LoRA): LCM's grid, then a
    # DDIM-like jump to s = floor((1 - eta) * t_next) and fresh noise up to t_next; its step
    # reads neither clip_sample, thresholding nor timestep_scaling (not listed), and like lcm's
    # its grid ignores timestep_spacing / steps_offset (listed: the class takes them)
    "tcd": {
        **_COMMON,
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "timestep_spacing": "leading",
        "original_inference_steps": 50,
        "rescale_betas_zero_snr": False,
    },
    # UniPC (Zhao et al. 2023), predictor UniP + corrector UniC on the x0 prediction (predict_x0);
    # solver_order, solver_type, lower_order_final and disable_corrector are read from the config
    "unipc": {
        **_COMMON,
        "timestep_spacing": "linspace",
        "solver_order": 2,
        "thresholding": False,
        "predict_x0": True,
        "solver_type": "bh2",
        "lower_order_final": True,
        "disable_corrector": [],
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "use_flow_sigmas": False,
        "final_sigmas_type": "zero",
        "rescale_betas_zero_snr": False,
        "sigma_min": None,
        "sigma_max": None,
    },
    # DEIS (Zhang & Chen 2022), log-rho multistep on the noise prediction: solver_order 1..3 and
    # lower_order_final are read from the config (its algorithm_type and solver_type have one value
    # each); the last step lands on the smallest training sigma, not 0
    "deis": {
        **_COMMON,
        "timestep_spacing": "linspace",
        "solver_order": 2,
        "thresholding": False,
        "lower_order_final": True,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "use_flow_sigmas": False,
        # read through the config (hasattr) by the Karras conversion, as for dpm++
        "sigma_min": None,
        "sigma_max": None,
    },
    # linear multistep (k-diffusion's LMS): Euler's schedule, the last four derivatives weighted by
    # the integrals of their Lagrange polynomials over each step (order 4, as pipelines call step)
    "lms": {
        **_COMMON,
        "timestep_spacing": "linspace",
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
    },
    # DPM-Solver-2 (k-diffusion's sample_dpm_2, "DPM2"): Euler to the log-midpoint sigma, the model there,
    # then the whole step with that derivative; Euler's schedule (its Karras timesteps rounded)
    "dpm2": _TWO_CALL,
    # its ancestral form ("DPM2 a"): the midpoint between sigma_i and euler_a's sigma_down, the step onto
    # sigma_down plus fresh noise of std sigma_up
    "dpm2_a": _TWO_CALL,
    # DPM-Solver++ SDE (k-diffusion's sample_dpmpp_sde, "DPM++ SDE"): two ancestral DPM-Solver-1 moves a
    # step, to the log-midpoint and on, their noise one Brownian path; its Karras ramp reads no
    # sigma_min / sigma_max (as LMS's); noise_sampler_seed is ignored (the noise is the request seed's)
    "dpmpp_sde": {key: v for key, v in _TWO_CALL.items() if key not in ("sigma_min", "sigma_max")},
    # DPM-Solver++(2S) (DPMSolverSinglestepScheduler, "DPM++ 2S"): dpm++'s keys less the spacing, offset and
    # zero-SNR rescale, which the class does not take (its timesteps are dpm++'s linspace ones, always); the
    # name fixes algorithm_type, solver_type, solver_order and Karras, as for dpmpp_2m
    "dpmpp_2s": _DPM_2S,
    "dpmpp_2s_karras": _DPM_2S,
    "flow_euler": {
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "use_dynamic_shifting": False,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "invert_sigmas": False,
        "shift_terminal": None,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "time_shift_type": "exponential",
        "stochastic_sampling": False,
        # read through the config (hasattr) by the Karras/exponential conversions
        "sigma_min": None,
        "sigma_max": None,
    },
    # FlowMatchHeunDiscreteScheduler reads nothing else: no dynamic shifting, no custom
    # sigmas, no mu (a Flux config's use_dynamic_shifting is ignored, as from_config does)
    "flow_heun": {"num_train_timesteps": 1000, "shift": 1.0},
    # EDM (continuous sigmas in [sigma_min, sigma_max]; num_train_timesteps only sizes the Plan)
    "edm_euler": _EDM,
    "edm_dpmpp_2m": _EDM_DPM,  # algorithm_type="dpmsolver++": the name decides, as for dpmpp_2m
    "edm_dpmpp_2m_sde": _EDM_DPM,  # algorithm_type="sde-dpmsolver++"
}

# Keys a sampler's class takes but its schedule ignores: a call that overrides one for that
# sampler is refused (``_config.with_overrides``) rather than silently changing nothing.
UNREAD_KEYS: dict[str, tuple[str, ...]] = {
    "lcm": ("timestep_spacing", "steps_offset"),  # the original_inference_steps grid decides
    "tcd": ("timestep_spacing", "steps_offset"),
}

# Keys only the FlowMatch* classes read / only the diffusion classes read / only the EDM* classes read
# (config_kind; EDM classes also read prediction_type, final_sigmas_type, thresholding and solver keys).
FLOW_KEYS: tuple[str, ...] = (
    "shift", "use_dynamic_shifting", "base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len",
    "invert_sigmas", "shift_terminal", "time_shift_type", "stochastic_sampling",
)
DIFFUSION_KEYS: tuple[str, ...] = (
    "beta_start", "beta_end", "beta_schedule", "prediction_type", "timestep_spacing", "steps_offset",
    "clip_sample", "clip_sample_range", "set_alpha_to_one", "variance_type", "interpolation_type",
    "use_lu_lambdas", "use_flow_sigmas", "thresholding", "rescale_betas_zero_snr", "timestep_type",
    "final_sigmas_type", "lambda_min_clipped", "original_inference_steps", "timestep_scaling",
    "skip_prk_steps",
)
EDM_KEYS: tuple[str, ...] = ("sigma_data", "sigma_schedule", "rho", "euler_at_final")

KIND_BOOL = "bool"
KIND_INT = "int"
KIND_FLOAT = "float"
KIND_STR = "str"
KIND_INTS = "list of ints"
FIELD_KIND: dict[str, str] = {
    "num_train_timesteps": KIND_INT,
    "beta_start": KIND_FLOAT,
    "beta_end": KIND_FLOAT,
    "beta_schedule": KIND_STR,
    "prediction_type": KIND_STR,
    "timestep_spacing": KIND_STR,
    "steps_offset": KIND_INT,
    "clip_sample": KIND_BOOL,
    "clip_sample_range": KIND_FLOAT,
    "set_alpha_to_one": KIND_BOOL,
    "variance_type": KIND_STR,
    "interpolation_type": KIND_STR,
    "use_karras_sigmas": KIND_BOOL,
    "use_exponential_sigmas": KIND_BOOL,
    "use_beta_sigmas": KIND_BOOL,
    "use_lu_lambdas": KIND_BOOL,
    "use_flow_sigmas": KIND_BOOL,
    "thresholding": KIND_BOOL,
    "rescale_betas_zero_snr": KIND_BOOL,
    "sigma_min": KIND_FLOAT,
    "sigma_max": KIND_FLOAT,
    "timestep_type": KIND_STR,
    "final_sigmas_type": KIND_STR,
    "lambda_min_clipped": KIND_FLOAT,
    "original_inference_steps": KIND_INT,
    "timestep_scaling": KIND_FLOAT,
    "solver_order": KIND_INT,
    "solver_type": KIND_STR,
    "predict_x0": KIND_BOOL,
    "lower_order_final": KIND_BOOL,
    "disable_corrector": KIND_INTS,
    "shift": KIND_FLOAT,
    "use_dynamic_shifting": KIND_BOOL,
    "base_shift": KIND_FLOAT,
    "max_shift": KIND_FLOAT,
    "base_image_seq_len": KIND_INT,
    "max_image_seq_len": KIND_INT,
    "invert_sigmas": KIND_BOOL,
    "shift_terminal": KIND_FLOAT,
    "time_shift_type": KIND_STR,
    "stochastic_sampling": KIND_BOOL,
    "skip_prk_steps": KIND_BOOL,
    "sigma_data": KIND_FLOAT,
    "sigma_schedule": KIND_STR,
    "rho": KIND_FLOAT,
    "euler_at_final": KIND_BOOL,
}
