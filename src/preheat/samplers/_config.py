"""Scheduler configuration: parse a diffusers ``scheduler_config.json`` and resolve it per sampler.

A ``scheduler_config.json`` saved by one diffusers class is routinely loaded into another
(``EulerDiscreteScheduler.from_config(ddim.config)``). diffusers then uses the values present
in the dict for the keys the *target* class reads, its own defaults for absent keys, and
silently ignores keys it does not read. We do the same, per sampler:

* :meth:`SchedulerConfig.from_dict` keeps the values present (``None`` = absent) and rejects
  values no supported class can honour (``beta_schedule="sigmoid"``, ``trained_betas``, ...).
* :func:`resolve` fills absent keys with the default of the diffusers class the sampler maps
  to and rejects values that class would read but we do not implement (``thresholding=True``
  for ddpm/ddim/dpm++, ``final_sigmas_type="sigma_min"`` for euler/dpm++, ...).

The sampler *name* fixes the solver: for ``dpmpp_2m``/``dpmpp_2m_karras`` (and
``dpmpp_2m_sde``/``dpmpp_2m_sde_karras``) the dict's ``algorithm_type``, ``solver_order``,
``solver_type``, ``lower_order_final``, ``euler_at_final`` and ``use_karras_sigmas`` are not
read (the name says 2nd-order dpmsolver++ / sde-dpmsolver++ midpoint, Karras or not; a
folder's own ``algorithm_type`` picks between them in ``families.text.default_sampler``).
``pndm`` is PNDMScheduler with ``skip_prk_steps=True`` (PLMS) whatever the dict says, except
that an explicit ``skip_prk_steps=False`` (the Runge-Kutta warm-up) is refused. ``euler``,
``heun``, ``unipc``, ``deis`` and ``lms`` honour ``use_karras_sigmas`` from the dict, as their diffusers
classes do; ``unipc`` reads ``solver_order``, ``solver_type``, ``lower_order_final`` and
``disable_corrector`` from it too (UniPCMultistepScheduler's own keys), ``deis`` its
``solver_order`` and ``lower_order_final``.

Flow matching, diffusion and EDM do not mix: a model trained for one cannot be sampled with
another, although diffusers' ``from_config`` would happily build any class from any dict.
:func:`config_kind` decides which family a config belongs to, and :func:`resolve` refuses a
sampler of the other family in one line naming the accepted samplers:

* ``_class_name`` present: ``FlowMatch*`` is flow, ``EDM*`` is EDM, any other class is diffusion;
* ``_class_name`` absent: a key only the ``FlowMatch*`` classes read (``shift``,
  ``use_dynamic_shifting``, ...) makes it flow, a key only the diffusion classes read
  (``beta_schedule``, ``prediction_type``, ...) makes it diffusion, one only the ``EDM*`` classes
  read (``sigma_data``, ``sigma_schedule``, ``rho``, ``euler_at_final``) makes it EDM (then the
  keys EDM shares with diffusion, ``prediction_type`` and the like, do not count); two kinds is
  refused, none (``{}``, ``{"num_train_timesteps": 1000}``) accepts every sampler.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from preheat.errors import SchedulerConfigError
from preheat.samplers._tables import (BETA_SCHEDULES, CLASS_DEFAULTS, DDPM_VARIANCE_TYPES, DIFFUSERS_CLASS,
                                      DIFFUSION_KEYS, DIFFUSION_SAMPLERS, EDM_KEYS, EDM_SAMPLERS, FIELD_KIND, FLOW_KEYS,
                                      FLOW_SAMPLERS, KIND_BOOL, KIND_FLOAT, KIND_INT, KIND_INTS, KIND_STR,
                                      PREDICTION_TYPES, SAMPLERS, SIGMA_SCHEDULES, TIME_SHIFT_TYPES, TIMESTEP_SPACINGS,
                                      UNREAD_KEYS)

__all__ = ["SchedulerConfig", "ResolvedConfig", "ResolvedFlowConfig", "ResolvedEdmConfig", "resolve", "resolve_flow",
           "resolve_edm", "config_kind", "check_sampler", "samplers_of_kind", "with_overrides", "load_scheduler_config",
           "find_scheduler_config"]



@dataclass(frozen=True)
class SchedulerConfig:
    """The math-relevant keys of a diffusers scheduler config; ``None`` means "absent".

    Absent keys (and keys listed in ``_use_default_values``) take the default of the diffusers
    class the chosen sampler maps to (see :func:`resolve`), because that is what
    ``Class.from_config(d)`` does. Keys that no sampler reads (``solver_order``,
    ``algorithm_type``, ...) are listed in ``ignored_keys``; ``_``-prefixed keys are dropped.
    """

    num_train_timesteps: int | None = None
    beta_start: float | None = None
    beta_end: float | None = None
    beta_schedule: str | None = None
    prediction_type: str | None = None
    timestep_spacing: str | None = None
    steps_offset: int | None = None
    clip_sample: bool | None = None
    clip_sample_range: float | None = None
    set_alpha_to_one: bool | None = None
    variance_type: str | None = None
    interpolation_type: str | None = None
    use_karras_sigmas: bool | None = None
    use_exponential_sigmas: bool | None = None
    use_beta_sigmas: bool | None = None
    use_lu_lambdas: bool | None = None
    use_flow_sigmas: bool | None = None
    thresholding: bool | None = None
    rescale_betas_zero_snr: bool | None = None
    sigma_min: float | None = None
    sigma_max: float | None = None
    timestep_type: str | None = None
    final_sigmas_type: str | None = None
    lambda_min_clipped: float | None = None
    original_inference_steps: int | None = None  # LCMScheduler: the distillation's step grid
    timestep_scaling: float | None = None  # LCMScheduler: the consistency boundary's time scale
    # UniPCMultistepScheduler and DEISMultistepScheduler (read by unipc and deis; dpm++'s name fixes its
    # own solver)
    solver_order: int | None = None
    solver_type: str | None = None
    predict_x0: bool | None = None
    lower_order_final: bool | None = None
    disable_corrector: tuple[int, ...] | None = None  # step indices whose *next* step skips the corrector
    # FlowMatchEulerDiscreteScheduler / FlowMatchHeunDiscreteScheduler
    shift: float | None = None
    use_dynamic_shifting: bool | None = None
    base_shift: float | None = None
    max_shift: float | None = None
    base_image_seq_len: int | None = None
    max_image_seq_len: int | None = None
    invert_sigmas: bool | None = None
    shift_terminal: float | None = None
    time_shift_type: str | None = None
    stochastic_sampling: bool | None = None
    skip_prk_steps: bool | None = None  # PNDMScheduler: False = Runge-Kutta warm-up (refused for pndm)
    # EDMEulerScheduler / EDMDPMSolverMultistepScheduler (sigma_min / sigma_max above are their range)
    sigma_data: float | None = None
    sigma_schedule: str | None = None
    rho: float | None = None
    euler_at_final: bool | None = None
    # the saving class (``_class_name``): decides flow matching vs diffusion (config_kind)
    class_name: str | None = None
    ignored_keys: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SchedulerConfig":
        """Parse a ``scheduler_config.json`` dict; reject values no sampler implements."""
        if not isinstance(d, Mapping):
            raise SchedulerConfigError(
                f"scheduler config must be a JSON object, got {type(d).__name__}"
            )
        values: dict[str, Any] = {}
        ignored: list[str] = []
        # An in-memory diffusers config lists under "_use_default_values" the keys that were
        # never set explicitly; from_config treats them as absent (the target class's default
        # applies). Saved JSON files do not carry the list.
        defaulted = d.get("_use_default_values") or ()
        class_name = d.get("_class_name")
        if class_name is not None and not isinstance(class_name, str):
            raise SchedulerConfigError(f"_class_name={class_name!r} has the wrong type; expected str")
        if class_name is not None:
            values["class_name"] = class_name
        for key, value in d.items():
            if not isinstance(key, str) or key.startswith("_") or key in defaulted:
                continue
            if key == "trained_betas":
                if value is not None:
                    raise SchedulerConfigError(
                        "trained_betas is not supported; use beta_schedule in "
                        f"{list(BETA_SCHEDULES)} with beta_start/beta_end"
                    )
                continue
            kind = FIELD_KIND.get(key)
            if kind is None:
                ignored.append(key)
                continue
            values[key] = _coerce(key, value, kind)
        return cls(**values, ignored_keys=tuple(sorted(ignored)))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "SchedulerConfig":
        """Read and parse a ``scheduler_config.json`` file."""
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise SchedulerConfigError(f"scheduler config not found: {os.fspath(path)}") from None
        except (OSError, ValueError) as e:
            raise SchedulerConfigError(
                f"cannot read scheduler config {os.fspath(path)}: {str(e).splitlines()[0]}"
            ) from None
        return cls.from_dict(d)

    def __post_init__(self) -> None:
        """Reject values that every supported diffusers class would read and we do not do."""
        _check_choice("beta_schedule", self.beta_schedule, BETA_SCHEDULES)
        _check_choice("prediction_type", self.prediction_type, PREDICTION_TYPES)
        _check_choice("timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        if self.num_train_timesteps is not None and self.num_train_timesteps < 2:
            raise SchedulerConfigError(
                f"num_train_timesteps={self.num_train_timesteps} is not supported; it must be >= 2"
            )
        if self.steps_offset is not None and self.steps_offset < 0:
            raise SchedulerConfigError(
                f"steps_offset={self.steps_offset} is not supported; it must be >= 0"
            )
        for key in ("beta_start", "beta_end"):
            v = getattr(self, key)
            if v is not None and not (0.0 < v < 1.0):
                raise SchedulerConfigError(f"{key}={v} is not supported; it must be in (0, 1)")
        if self.clip_sample_range is not None and not self.clip_sample_range > 0:
            raise SchedulerConfigError(
                f"clip_sample_range={self.clip_sample_range} is not supported; it must be > 0"
            )
        _check_choice("time_shift_type", self.time_shift_type, TIME_SHIFT_TYPES)
        _check_choice("sigma_schedule", self.sigma_schedule, SIGMA_SCHEDULES)
        for key in ("sigma_data", "rho"):
            v = getattr(self, key)
            if v is not None and not v > 0:
                raise SchedulerConfigError(f"{key}={v} is not supported; it must be > 0")
        if self.shift is not None and not self.shift > 0:
            raise SchedulerConfigError(f"shift={self.shift} is not supported; it must be > 0")
        # diffusers tests ``if shift_terminal:``, so 0 means "off"; 1 would divide by zero
        if self.shift_terminal is not None and not 0.0 <= self.shift_terminal < 1.0:
            raise SchedulerConfigError(
                f"shift_terminal={self.shift_terminal} is not supported; it must be in [0, 1) (0 = off)"
            )
        for key in ("base_image_seq_len", "max_image_seq_len", "original_inference_steps"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise SchedulerConfigError(f"{key}={v} is not supported; it must be >= 1")
        if self.timestep_scaling is not None and not self.timestep_scaling > 0:
            raise SchedulerConfigError(f"timestep_scaling={self.timestep_scaling} is not supported; it must be > 0")


@dataclass(frozen=True)
class ResolvedConfig:
    """Every setting one sampler needs, absent keys filled with its diffusers class default."""

    sampler: str
    num_train_timesteps: int
    beta_start: float
    beta_end: float
    beta_schedule: str
    prediction_type: str
    timestep_spacing: str
    steps_offset: int
    clip_sample: bool  # False for samplers whose diffusers class has no clipping
    clip_sample_range: float
    set_alpha_to_one: bool  # ddim, lcm, pndm
    variance_type: str  # ddpm only ("" otherwise)
    use_karras_sigmas: bool
    sigma_min: float | None  # Karras endpoints; None = the schedule's own
    sigma_max: float | None
    lambda_min_clipped: float  # dpm++ only
    original_inference_steps: int = 0  # lcm, tcd only
    timestep_scaling: float = 0.0  # lcm only
    final_sigma_min: bool = False  # unipc, deis: the last step lands on the smallest training sigma, not 0
    solver_order: int = 0  # unipc, deis (1..3)
    solver_type: str = ""  # unipc only: "bh1" | "bh2"
    lower_order_final: bool = True  # unipc, deis
    disable_corrector: tuple[int, ...] = ()  # unipc only
    rescale_betas_zero_snr: bool = False  # the betas rescaled to zero terminal SNR (the classes that read it)


@dataclass(frozen=True)
class ResolvedFlowConfig:
    """Every setting a flow-matching sampler needs (FlowMatch*DiscreteScheduler's keys)."""

    sampler: str
    num_train_timesteps: int
    shift: float
    use_dynamic_shifting: bool  # always False for flow_heun (its class has no such key)
    base_shift: float
    max_shift: float
    base_image_seq_len: int
    max_image_seq_len: int
    invert_sigmas: bool
    shift_terminal: float | None  # None = off
    sigma_conversion: str  # "" | "karras" | "exponential"
    sigma_min: float | None  # conversion endpoints; None = the schedule's own
    sigma_max: float | None
    time_shift_type: str


# Which samplers each kind of config takes, and how messages name the kinds.
_SAMPLERS_OF_KIND: dict[str, tuple[str, ...]] = {"diffusion": DIFFUSION_SAMPLERS, "flow": FLOW_SAMPLERS,
                                                 "edm": EDM_SAMPLERS}
_MODELS_OF_KIND = {"diffusion": "diffusion", "flow": "flow-matching", "edm": "EDM"}
_CONFIG_OF_KIND = {"diffusion": "diffusion", "flow": "flow matching", "edm": "EDM"}


@dataclass(frozen=True)
class ResolvedEdmConfig:
    """Every setting an EDM sampler needs (EDMEulerScheduler's / EDMDPMSolverMultistepScheduler's keys)."""

    sampler: str
    num_train_timesteps: int  # sizes the padded Plan only (the sigmas are continuous)
    sigma_min: float
    sigma_max: float
    sigma_data: float  # the data's std: c_in, c_skip and c_out's scale
    sigma_schedule: str  # "karras" | "exponential"
    rho: float  # the Karras ramp's exponent
    prediction_type: str  # "epsilon" | "v_prediction" (what the preconditioned network outputs)
    final_sigma_min: bool  # the last step lands on sigma_min (else 0)
    solver_order: int = 1  # edm_dpmpp_2m(_sde): 1 or 2
    solver_type: str = ""  # edm_dpmpp_2m(_sde): "midpoint" | "heun"
    lower_order_final: bool = True
    euler_at_final: bool = False


def config_kind(config: SchedulerConfig) -> str | None:
    """"flow", "diffusion", "edm", or None (no ``_class_name`` and no telling key: any sampler).

    See the module docstring for the rule.
    """
    if config.class_name is not None:
        return ("flow" if config.class_name.startswith("FlowMatch") else
                "edm" if config.class_name.startswith("EDM") else "diffusion")
    flow = [k for k in FLOW_KEYS if getattr(config, k) is not None]
    edm = [k for k in EDM_KEYS if getattr(config, k) is not None]
    # keys the EDM classes read too (prediction_type, final_sigmas_type, ...) do not tell diffusion from EDM
    diffusion = [k for k in DIFFUSION_KEYS if getattr(config, k) is not None
                 and not (edm and k in CLASS_DEFAULTS["edm_dpmpp_2m"])]
    found = [(kind, keys) for kind, keys in (("flow", flow), ("diffusion", diffusion), ("edm", edm)) if keys]
    if len(found) > 1:
        mixed = " with ".join(f"{_key_words(kind)} ({', '.join(keys)})" for kind, keys in found)
        raise SchedulerConfigError(
            f"scheduler config mixes {mixed} and has no _class_name; add _class_name to say which it is"
        )
    return found[0][0] if found else None


def _key_words(kind: str) -> str:
    return f"{_CONFIG_OF_KIND[kind].replace(' ', '-')} keys"


def samplers_of_kind(config: SchedulerConfig) -> tuple[str, ...]:
    """The samplers ``config`` takes: its kind's (every sampler when nothing tells the kind)."""
    kind = config_kind(config)
    return SAMPLERS if kind is None else _SAMPLERS_OF_KIND[kind]


def check_sampler(config: SchedulerConfig, sampler: str) -> None:
    """``sampler`` is known and belongs to the config's kind (diffusion, flow matching, EDM)."""
    if sampler not in SAMPLERS:
        raise SchedulerConfigError(
            f"unknown sampler {sampler!r}; supported: {', '.join(SAMPLERS)}"
        )
    kind = config_kind(config)
    if kind is not None and sampler not in _SAMPLERS_OF_KIND[kind]:
        own = next(k for k, samplers in _SAMPLERS_OF_KIND.items() if sampler in samplers)
        what = config.class_name or _key_words(kind)
        raise SchedulerConfigError(
            f"sampler {sampler!r} is for {_MODELS_OF_KIND[own]} models, but the scheduler config is "
            f"{_CONFIG_OF_KIND[kind]} ({what}); supported: {', '.join(_SAMPLERS_OF_KIND[kind])}"
        )


def with_overrides(config: SchedulerConfig, sampler: str, overrides: Mapping[str, Any]) -> SchedulerConfig:
    """``config`` with some keys set for one call: what ``Class.from_config(config, **overrides)``
    gives the sampler's diffusers class (a model card's ``timestep_spacing="trailing"``).

    A key the sampler's class does not read (or reads and ignores, as lcm's grid ignores the
    spacing) is refused in one line naming it: it would change nothing.
    """
    if not overrides:
        return config
    check_sampler(config, sampler)
    values: dict[str, Any] = {}
    for key, value in overrides.items():
        kind = FIELD_KIND.get(key)
        if kind is None or key not in CLASS_DEFAULTS[sampler] or key in UNREAD_KEYS.get(sampler, ()):
            raise SchedulerConfigError.about("{0} does not apply to {1} {sampler!r}: {scheduler} does not read it", key,
                                             "sampler", sampler=sampler, scheduler=DIFFUSERS_CLASS[sampler])
        values[key] = _coerce(key, value, kind)
    return dataclasses.replace(config, **values)  # __post_init__ checks the new values


def resolve_flow(config: SchedulerConfig, sampler: str) -> ResolvedFlowConfig:
    """Fill absent keys for a flow sampler and reject values its diffusers class would use."""
    check_sampler(config, sampler)
    if sampler not in FLOW_SAMPLERS:
        raise SchedulerConfigError(f"sampler {sampler!r} is not a flow sampler; use {', '.join(FLOW_SAMPLERS)}")
    defaults = CLASS_DEFAULTS[sampler]
    cls_name = DIFFUSERS_CLASS[sampler]

    def get(key: str) -> Any:
        if key not in defaults:  # the class does not read it
            return None
        v = getattr(config, key)
        return defaults[key] if v is None else v

    for key in ("stochastic_sampling", "use_beta_sigmas"):
        if get(key):
            raise SchedulerConfigError(
                f"{key}=True is not supported for sampler {sampler!r} ({cls_name}); only {key}=False is"
            )
    conversions = [k for k in ("use_karras_sigmas", "use_exponential_sigmas") if get(k)]
    if len(conversions) > 1:
        raise SchedulerConfigError(
            f"{' and '.join(conversions)} are both True; {cls_name} takes at most one sigma conversion"
        )
    def shift_line(key: str) -> Any:
        # flow_mu's inputs: the pipelines read them from the config (FlowMatchEuler's defaults)
        v = getattr(config, key)
        return CLASS_DEFAULTS["flow_euler"][key] if v is None else v

    shift_terminal = get("shift_terminal")
    return ResolvedFlowConfig(
        sampler=sampler,
        num_train_timesteps=int(get("num_train_timesteps")),
        shift=float(get("shift")),
        use_dynamic_shifting=bool(get("use_dynamic_shifting")),
        base_shift=float(shift_line("base_shift")),
        max_shift=float(shift_line("max_shift")),
        base_image_seq_len=int(shift_line("base_image_seq_len")),
        max_image_seq_len=int(shift_line("max_image_seq_len")),
        invert_sigmas=bool(get("invert_sigmas")),
        shift_terminal=float(shift_terminal) if shift_terminal else None,  # diffusers: ``if shift_terminal:``
        sigma_conversion=conversions[0][4:-7] if conversions else "",  # "use_karras_sigmas" -> "karras"
        sigma_min=_opt_float(get("sigma_min")),
        sigma_max=_opt_float(get("sigma_max")),
        time_shift_type=get("time_shift_type") or "exponential",
    )


def resolve(config: SchedulerConfig, sampler: str) -> ResolvedConfig:
    """Fill absent keys for a diffusion ``sampler`` and reject values its diffusers class would use."""
    check_sampler(config, sampler)
    if sampler not in DIFFUSION_SAMPLERS:
        other = "resolve_flow" if sampler in FLOW_SAMPLERS else "resolve_edm"
        raise SchedulerConfigError(f"sampler {sampler!r} is not a diffusion sampler; resolve it with {other}")
    defaults = CLASS_DEFAULTS[sampler]
    cls_name = DIFFUSERS_CLASS[sampler]

    def get(key: str) -> Any:
        v = getattr(config, key)
        return defaults[key] if v is None else v

    def refuse_true(key: str) -> None:
        if key in defaults and get(key):
            raise SchedulerConfigError(
                f"{key}=True is not supported for sampler {sampler!r} ({cls_name}); "
                f"only {key}=False is"
            )

    for key in ("thresholding", "use_exponential_sigmas",
                "use_beta_sigmas", "use_lu_lambdas", "use_flow_sigmas"):
        refuse_true(key)
    if "final_sigmas_type" in defaults:
        _check_choice("final_sigmas_type", get("final_sigmas_type"),
                      ("zero", "sigma_min") if sampler == "unipc" else ("zero",), sampler)
    if "interpolation_type" in defaults:
        _check_choice("interpolation_type", get("interpolation_type"), ("linear",), sampler)

    prediction_type = get("prediction_type")
    if "timestep_type" in defaults:
        timestep_type = get("timestep_type")
        _check_choice("timestep_type", timestep_type, ("discrete", "continuous"), sampler)
        if timestep_type == "continuous" and prediction_type == "v_prediction":
            raise SchedulerConfigError(
                "timestep_type='continuous' with prediction_type='v_prediction' is not "
                f"supported for sampler {sampler!r}; use timestep_type='discrete'"
            )

    if sampler in ("dpm2", "dpm2_a", "dpmpp_sde"):  # their diffusers classes' step raises on "sample"
        _check_choice("prediction_type", prediction_type, ("epsilon", "v_prediction"), sampler)
    if sampler == "pndm":
        if config.skip_prk_steps is False:
            raise SchedulerConfigError(
                "skip_prk_steps=False (PNDM's Runge-Kutta warm-up) is not supported for sampler 'pndm' "
                "(PNDMScheduler); only skip_prk_steps=True (PLMS) is"
            )
        # diffusers' PNDMScheduler raises on it too
        _check_choice("prediction_type", prediction_type, ("epsilon", "v_prediction"), sampler)

    variance_type = ""
    if sampler == "ddpm":
        variance_type = get("variance_type")
        _check_choice("variance_type", variance_type, DDPM_VARIANCE_TYPES, sampler)
    elif sampler.startswith(("dpmpp_2m", "dpmpp_2s")) and config.variance_type in ("learned", "learned_range"):
        # diffusers' dpm++ acts on these two only (it drops the variance channels)
        raise SchedulerConfigError(
            f"variance_type={config.variance_type!r} (learned variance) is not supported for "
            f"sampler {sampler!r}; a model with learned variance cannot be used"
        )

    if sampler in ("dpmpp_2m_karras", "dpmpp_2m_sde_karras", "dpmpp_2s_karras"):
        use_karras = True
    elif sampler in ("dpmpp_2m", "dpmpp_2m_sde", "dpmpp_2s"):
        use_karras = False
    elif "use_karras_sigmas" in defaults:  # euler, heun, unipc, deis, lms, dpm2(_a), dpmpp_sde: as their classes do
        use_karras = bool(get("use_karras_sigmas"))
    else:  # ddpm, ddim, euler_a: their diffusers classes do not read the key
        use_karras = False

    lambda_min_clipped = float(get("lambda_min_clipped")) if "lambda_min_clipped" in defaults else -math.inf
    if math.isnan(lambda_min_clipped):
        raise SchedulerConfigError("lambda_min_clipped=nan is not supported; use a number or -inf")

    multistep = _resolve_unipc(get) if sampler == "unipc" else _resolve_deis(get) if sampler == "deis" else {}
    has_clip = "clip_sample" in defaults
    return ResolvedConfig(
        sampler=sampler,
        num_train_timesteps=int(get("num_train_timesteps")),
        beta_start=float(get("beta_start")),
        beta_end=float(get("beta_end")),
        beta_schedule=get("beta_schedule"),
        prediction_type=prediction_type,
        # DPMSolverSinglestepScheduler takes neither: its timesteps are always dpm++'s linspace ones
        timestep_spacing=get("timestep_spacing") if "timestep_spacing" in defaults else "linspace",
        steps_offset=int(get("steps_offset")) if "steps_offset" in defaults else 0,
        clip_sample=bool(get("clip_sample")) if has_clip else False,
        clip_sample_range=float(get("clip_sample_range")) if has_clip else 1.0,
        set_alpha_to_one=bool(get("set_alpha_to_one")) if sampler in ("ddim", "lcm", "pndm") else True,
        variance_type=variance_type,
        use_karras_sigmas=use_karras,
        sigma_min=_opt_float(get("sigma_min")) if "sigma_min" in defaults else None,
        sigma_max=_opt_float(get("sigma_max")) if "sigma_max" in defaults else None,
        lambda_min_clipped=lambda_min_clipped,
        original_inference_steps=int(get("original_inference_steps")) if sampler in ("lcm", "tcd") else 0,
        timestep_scaling=float(get("timestep_scaling")) if sampler == "lcm" else 0.0,
        rescale_betas_zero_snr=bool(get("rescale_betas_zero_snr")) if "rescale_betas_zero_snr" in defaults else False,
        **multistep,
    )


def resolve_edm(config: SchedulerConfig, sampler: str) -> ResolvedEdmConfig:
    """Fill absent keys for an EDM sampler and refuse values its diffusers class would use that we do not."""
    check_sampler(config, sampler)
    if sampler not in EDM_SAMPLERS:
        raise SchedulerConfigError(f"sampler {sampler!r} is not an EDM sampler; use {', '.join(EDM_SAMPLERS)}")
    defaults = CLASS_DEFAULTS[sampler]
    where = f"for sampler {sampler!r} ({DIFFUSERS_CLASS[sampler]})"

    def get(key: str) -> Any:
        v = getattr(config, key) if key in defaults else None
        return defaults.get(key) if v is None else v

    # its precondition_outputs raises on "sample", so a pipeline could not run it either
    _check_choice("prediction_type", get("prediction_type"), ("epsilon", "v_prediction"), sampler)
    _check_choice("final_sigmas_type", get("final_sigmas_type"), ("zero", "sigma_min"), sampler)
    sigma_min, sigma_max = float(get("sigma_min")), float(get("sigma_max"))
    if not 0 < sigma_min < sigma_max:
        raise SchedulerConfigError(f"sigma_min={sigma_min} and sigma_max={sigma_max} are not supported {where}; "
                                   "they must satisfy 0 < sigma_min < sigma_max")
    dpm: dict[str, Any] = {}
    if sampler != "edm_euler":
        if get("thresholding"):
            raise SchedulerConfigError(f"thresholding=True is not supported {where}; only thresholding=False is")
        order = int(get("solver_order"))
        if order not in (1, 2):
            raise SchedulerConfigError(f"solver_order={order} is not supported {where}; supported: 1, 2")
        solver_type = get("solver_type")
        if solver_type in ("logrho", "bh1", "bh2"):  # the class registers these as midpoint
            solver_type = "midpoint"
        _check_choice("solver_type", solver_type, ("midpoint", "heun"), sampler)
        dpm = dict(solver_order=order, solver_type=solver_type, lower_order_final=bool(get("lower_order_final")),
                   euler_at_final=bool(get("euler_at_final")))
    return ResolvedEdmConfig(
        sampler=sampler,
        num_train_timesteps=int(get("num_train_timesteps")),
        sigma_min=sigma_min,
        sigma_max=sigma_max,
        sigma_data=float(get("sigma_data")),
        sigma_schedule=get("sigma_schedule"),
        rho=float(get("rho")),
        prediction_type=get("prediction_type"),
        final_sigma_min=get("final_sigmas_type") == "sigma_min",
        **dpm,
    )


def _resolve_unipc(get: Any) -> dict[str, Any]:
    """UniPCMultistepScheduler's own keys (ResolvedConfig fields), refusing what we do not do."""
    where = "for sampler 'unipc' (UniPCMultistepScheduler)"
    if not get("predict_x0"):
        raise SchedulerConfigError(f"predict_x0=False is not supported {where}; only predict_x0=True is")
    order = int(get("solver_order"))
    if not 1 <= order <= 3:
        raise SchedulerConfigError(f"solver_order={order} is not supported {where}; supported: 1, 2, 3")
    solver_type = get("solver_type")
    if solver_type in ("midpoint", "heun", "logrho"):  # dpm-solver's names: diffusers' UniPC takes them as bh2
        solver_type = "bh2"
    _check_choice("solver_type", solver_type, ("bh1", "bh2"), "unipc")
    final_sigma_min = get("final_sigmas_type") == "sigma_min"
    if final_sigma_min and get("use_karras_sigmas"):
        # the Karras ramp already ends at sigma_min: a last step of length 0 (diffusers divides by it)
        raise SchedulerConfigError(
            f"final_sigmas_type='sigma_min' with use_karras_sigmas=True is not supported {where}: its last "
            "step would not move; use final_sigmas_type='zero'")
    lower_order_final = bool(get("lower_order_final"))
    if not lower_order_final and order > 1 and not final_sigma_min:
        # h = lambda(0) - lambda(s) is infinite on the last step; only the 1st-order update has a limit there
        raise SchedulerConfigError(
            f"lower_order_final=False with final_sigmas_type='zero' is not supported {where}: its last "
            "step onto sigma 0 is not finite (diffusers returns inf); use lower_order_final=True")
    return dict(final_sigma_min=final_sigma_min, solver_order=order, solver_type=solver_type,
                lower_order_final=lower_order_final, disable_corrector=tuple(get("disable_corrector")))


def _resolve_deis(get: Any) -> dict[str, Any]:
    """DEISMultistepScheduler's own keys (ResolvedConfig fields). Its last step always lands on the
    smallest training sigma (or the Karras ramp's last), never 0, so every order is finite there."""
    order = int(get("solver_order"))
    if not 1 <= order <= 3:
        raise SchedulerConfigError(f"solver_order={order} is not supported for sampler 'deis' "
                                   "(DEISMultistepScheduler); supported: 1, 2, 3")
    return dict(final_sigma_min=True, solver_order=order, lower_order_final=bool(get("lower_order_final")))


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _check_choice(key: str, value: Any, allowed: tuple[Any, ...], sampler: str | None = None) -> None:
    if value is None or value in allowed:
        return
    where = f" for sampler {sampler!r}" if sampler else ""
    raise SchedulerConfigError(
        f"{key}={value!r} is not supported{where}; supported: {', '.join(map(repr, allowed))}"
    )


def _coerce(key: str, value: Any, kind: str) -> Any:
    """Check a JSON value's type; ``None`` stays ``None`` (= absent)."""
    if value is None:
        return None
    if kind == KIND_BOOL:
        if isinstance(value, bool):
            return value
    elif kind == KIND_INT:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind == KIND_FLOAT:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            v = float(value)
            if math.isnan(v) or (math.isinf(v) and key != "lambda_min_clipped"):
                raise SchedulerConfigError(f"{key}={value!r} is not supported; it must be finite")
            return v
    elif kind == KIND_STR:
        if isinstance(value, str):
            return value
    elif kind == KIND_INTS:
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
    raise SchedulerConfigError(f"{key}={value!r} has the wrong type; expected {kind}")


def load_scheduler_config(source: "SchedulerConfig | Mapping[str, Any] | str | os.PathLike[str]") -> SchedulerConfig:
    """A SchedulerConfig from itself, a dict, a scheduler_config.json or the folder holding it."""
    from pathlib import Path

    from preheat.errors import ModelNotFoundError

    if isinstance(source, SchedulerConfig):
        return source
    if isinstance(source, Mapping):
        return SchedulerConfig.from_dict(dict(source))
    path = Path(source)
    if path.is_dir():
        path = path / "scheduler_config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"scheduler config {path} does not exist")
    return SchedulerConfig.from_file(path)


def find_scheduler_config(root: "str | os.PathLike[str]", model_dir: "str | os.PathLike[str]") -> "os.PathLike[str]":
    """The scheduler config of a pipeline folder (``scheduler/``) or next to a bare model."""
    from pathlib import Path

    from preheat.errors import ModelNotFoundError

    root, model_dir = Path(root), Path(model_dir)
    for candidate in (root / "scheduler" / "scheduler_config.json", root / "scheduler_config.json",
                      model_dir / "scheduler_config.json"):
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"{root} has no scheduler/scheduler_config.json; pass scheduler=PATH for a bare model folder")
