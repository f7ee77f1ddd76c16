"""One request validation for every backend: a call's arguments -> a validated :class:`Request`.

Pure host-side functions of what a pipeline shows (:class:`ArgumentView`: its family, defaults,
scheduler config, sizes), with no device work and no engine import. The JAX pipeline
(``preheat.engine``) and both torch pipelines (``preheat.backends.torch``) call them, so a call
is checked with the same words, defaults and bounds whichever backend runs it.

    validate(pipe, first, inputs)   the call -> Request (n, sampler, steps, guidance, seeds,
                                    noise, eta, the family's values, the LoRA request)
    check(pipe, first, inputs)      validate + the sampler's schedule for that step count
    plan(pipe, request)             the schedule (``preheat.samplers.make_plan``)
    plan_inputs(pipe, r)            the call's own set_timesteps arguments (``plan_key`` inputs)
    scheduler_overrides(pipe, r)    the scheduler config keys the call sets (``scheduler_key`` inputs)
    scheduler_config(pipe, r)       the folder's scheduler config with them (what plan and spec read)
    guidance(pipe, g, values)       a ``GuidanceChoice``: CFG on?, the model's scale, CFG's scale
    concat(pipe, requests, pad)     validated requests of one batch key -> one Request (a
                                    server's batch: validated once, at parse time)
    images(pixels)                  uint8 (n, H, W, C) -> PIL images

Surfaces (server, CLI, warm, bench) see any pipeline as a :class:`SamplingPipeline`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

from preheat.errors import InvalidArgumentError, SchedulerConfigError
from preheat.families.base import Family, Request
from preheat.families.inputs import COMMON_SPECS, common_spec
from preheat.samplers import SAMPLERS, Plan, SchedulerConfig, make_plan, make_spec, samplers_of_kind, with_overrides

__all__ = ["ArgumentView", "SamplingPipeline", "validate", "concat", "check", "plan", "plan_inputs",
           "scheduler_overrides", "scheduler_config", "guidance", "GuidanceChoice", "initial_noise", "seeds_for",
           "images", "resolved_defaults", "COMMON_INPUTS"]

COMMON_INPUTS = tuple(s.name for s in COMMON_SPECS)


class ArgumentView(Protocol):
    """What argument handling reads of a pipeline (JAX or torch)."""

    family: Family
    defaults: dict[str, Any]
    scheduler_config: SchedulerConfig
    sample_shape: tuple[int, ...]
    layout: str
    num_classes: int | None
    null_class: int | None
    labels: tuple[str, ...]
    components: Any  # preheat.families.components.Components (typed, frozen)
    lora_runtime: Any  # preheat.lora.LoraRuntime; None when the model takes no LoRA (always on torch)


class SamplingPipeline(ArgumentView, Protocol):
    """What every surface uses of a pipeline, the JAX engine's and both torch ones alike: no
    surface probes for an attribute (``getattr``/``hasattr``); where a backend has no such thing
    it is None (``startup``, ``load_report``, ``compiler`` when not caching)."""

    compiler: Any
    last: Any  # preheat.timings.Timings of the last call
    startup: Any  # preheat.timings.Phases of load() and the first call; None on torch
    load_report: Any  # preheat.models.load_report.LoadReport; None on torch
    reports_progress: bool  # run(..., progress=) / generate(..., progress=) report steps (False on torch)

    @property
    def device_count(self) -> int: ...

    def __call__(self, first: Any = None, /, **inputs: Any) -> list: ...

    def generate(self, first: Any = None, /, **inputs: Any) -> np.ndarray: ...

    def run(self, request: Request) -> np.ndarray: ...

    def validate(self, first: Any = None, /, **inputs: Any) -> Request: ...

    def check(self, first: Any = None, /, **inputs: Any) -> Request: ...

    def is_guided(self, guidance: float | None = None, **inputs: Any) -> bool: ...

    def class_index(self, c: Any) -> int: ...


def resolved_defaults(family: Family, own: Mapping[str, Any]) -> dict[str, Any]:
    """The family's sampler / steps / guidance defaults, overridden by the folder's own."""
    return {**family.defaults, **{k: v for k, v in own.items() if k in ("sampler", "steps", "guidance")}}


def _first_positional(first: Any, inputs: dict[str, Any], family: Family) -> Any:
    """``pipe(8, ...)`` (n) or, for a family with a positional input, ``pipe("a fox", ...)`` / ``pipe([...])``."""
    if isinstance(first, str) or (isinstance(first, (list, tuple)) and first and all(isinstance(p, str) for p in first)):
        name = family.positional
        if name is None:
            raise InvalidArgumentError(f"a {family.name} model takes no prompt; call it with n (an int)",
                                       argument="prompt")
        if name in inputs:
            raise InvalidArgumentError(f"{name} given twice", argument=name)
        inputs[name] = first
        n = inputs.pop("n", None)
        if n is None:
            return 1 if isinstance(first, str) else len(first)
        return n
    if first is not None and "n" in inputs:
        raise InvalidArgumentError("n given twice", argument="n")
    n = inputs.pop("n", None) if first is None else first
    if n is None:
        given = inputs.get(family.positional) if family.positional else None
        return len(given) if isinstance(given, (list, tuple)) else 1
    return n


def accepted_samplers(pipe: ArgumentView) -> tuple[str, ...]:
    """The samplers a call on this model may name: its family's that suit its scheduler config's kind
    (an SDXL folder saved with an EDM scheduler takes the EDM samplers, one saved with Euler the others)."""
    fits = samplers_of_kind(pipe.scheduler_config)
    return tuple(s for s in pipe.family.samplers if s in fits)


def validate(pipe: ArgumentView, first: Any, inputs: Mapping[str, Any]) -> Request:
    """Check a call's arguments (host-side only: nothing runs on the device) into a Request."""
    inputs = dict(inputs)
    family = pipe.family
    n = common_spec("n").check(_first_positional(first, inputs, family), 1)
    common = {k: inputs.pop(k) for k in COMMON_INPUTS if k in inputs}
    sampler = common.get("sampler") or pipe.defaults["sampler"]
    accepted = accepted_samplers(pipe)
    if sampler not in SAMPLERS:
        raise SchedulerConfigError.about("unknown {0} {value!r}; supported: {accepted}", "sampler", value=sampler,
                                         accepted=", ".join(accepted))
    if sampler not in accepted:
        raise SchedulerConfigError.about("{0} {value!r} is not for a {family} model; use one of: {accepted}",
                                         "sampler", value=sampler, family=family.name, accepted=", ".join(accepted))
    values = family.check_inputs(pipe, n, inputs)
    steps = _steps(pipe, common.get("steps"), values)
    shape = family.sample_shape(pipe, values)
    guided, scale, cfg_scale = guidance(pipe, common.get("guidance"), values)
    if not guided:
        family.check_unguided(pipe, values)
    seeds = seeds_for(n, 0 if common.get("seed") is None else common["seed"])
    noise = common.get("noise")
    noise_arr = initial_noise(pipe, n, noise, shape) if noise is not None else None
    eta = common.get("eta", 0.0)
    eta = 0.0 if eta is None else _number("eta", eta)
    lora = None
    if common.get("lora") is not None or common.get("lora_scale") is not None:  # else preheat.lora stays unimported
        from preheat.lora import parse_request

        lora = parse_request(pipe, n, common.get("lora"), common.get("lora_scale"))
    request = Request(n=n, sampler=sampler, steps=steps, guided=guided, guidance=scale, seeds=seeds,
                      noise=noise_arr, eta=eta, sample_shape=shape, values=values, lora=lora, cfg_scale=cfg_scale)
    scheduler_config(pipe, request)  # a key the sampler does not read: one line naming the input
    return request


def _steps(pipe: ArgumentView, given: Any, values: Mapping[str, Any]) -> int:
    """The call's step count: ``given``; else the length of a given ``counts_steps`` input (custom
    timesteps: diffusers' ``set_timesteps(timesteps=)`` makes ``num_inference_steps`` their count);
    else the model's default. A given count that is not that length is one line naming both."""
    counted = [(s.name, len(values[s.name])) for s in pipe.family.input_specs(pipe)
               if s.counts_steps and values.get(s.name) is not None]
    if given is None:
        return common_spec("steps").check(counted[0][1] if counted else pipe.defaults["steps"], 1)
    steps = common_spec("steps").check(given, 1)
    for name, count in counted:
        if steps != count:
            raise InvalidArgumentError.about("{0} has {count} entries but {1}={steps}; leave {1} out or give "
                                             "{1}={count}", name, "steps", count=count, steps=steps)
    return steps


def check(pipe: ArgumentView, first: Any, inputs: Mapping[str, Any]) -> Request:
    """Every host-side check of a call (``validate`` plus the sampler's schedule for this step
    count), with no device work: what a server runs before it accepts a request."""
    request = validate(pipe, first, inputs)
    make_spec(scheduler_config(pipe, request), request.sampler)
    plan(pipe, request)
    pipe.family.check_start(pipe, request)  # img2img: a strength that leaves a step to run
    return request


def plan(pipe: ArgumentView, request: Request) -> Plan:
    """The request's schedule (host-side; the family adds flow models' ``mu`` / ``sigmas``, the call's
    ``plan_key`` inputs their own keywords)."""
    return make_plan(scheduler_config(pipe, request), request.sampler, request.steps, eta=request.eta,
                     **pipe.family.plan_options(pipe, request), **plan_inputs(pipe, request))


def plan_inputs(pipe: ArgumentView, request: Request) -> dict[str, Any]:
    """The call's given ``plan_key`` inputs: what it passes to ``set_timesteps`` (a card's
    ``timesteps=[800]``); the torch backend hands them to diffusers' pipeline as they are."""
    return {s.name: request.values[s.name] for s in pipe.family.input_specs(pipe)
            if s.plan_key and request.values.get(s.name) is not None}


def scheduler_overrides(pipe: ArgumentView, request: Request) -> dict[str, Any]:
    """The folder's scheduler config keys this call sets: its given ``scheduler_key`` inputs (a
    card's ``timestep_spacing="trailing"``). The torch backend merges them into the config dict
    its diffusers scheduler is built from; the JAX engine reads :func:`scheduler_config`."""
    return {s.name: request.values[s.name] for s in pipe.family.input_specs(pipe)
            if s.scheduler_key and request.values.get(s.name) is not None}


def scheduler_config(pipe: ArgumentView, request: Request) -> SchedulerConfig:
    """The scheduler config this call samples with: the folder's, with the call's overrides."""
    return with_overrides(pipe.scheduler_config, request.sampler, scheduler_overrides(pipe, request))


def _number(name: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError.about("{0}={value!r} must be a number", name, value=value) from None


class GuidanceChoice(NamedTuple):
    """How a call is guided: ``guided`` runs classifier-free guidance (two branches), combined at
    ``cfg_scale``; ``scale`` is the model's guidance scale (CFG's own, or an embedded input's)."""

    guided: bool
    scale: float
    cfg_scale: float  # the CFG combination's scale when guided: ``scale``, or the family's ``true_cfg``; else 1


def guidance(pipe: ArgumentView, scale: Any, values: dict[str, Any]) -> GuidanceChoice:
    """The call's guidance. An "embedded" scale is data, never a second branch; a model whose
    guidance is not CFG may still run CFG on the family's own input (``Family.true_cfg``)."""
    family = pipe.family
    mode = family.guidance_mode(pipe)
    if mode != "cfg":
        true_cfg = family.true_cfg(values)
        guided, cfg_scale = true_cfg is not None, 1.0 if true_cfg is None else true_cfg
    if mode == "none":  # 1 means "off" everywhere in preheat, so it is accepted here too
        if scale is not None and not (isinstance(scale, (int, float)) and float(scale) == 1.0):
            raise InvalidArgumentError.about("{0}={scale!r}: this {family} model takes no guidance (it has no "
                                             "guidance input); leave it unset", "guidance", scale=scale,
                                             family=family.name)
        return GuidanceChoice(guided, 1.0, cfg_scale)
    g = pipe.defaults.get("guidance") if scale is None else scale
    if g is None:
        return GuidanceChoice(False, 1.0, 1.0) if mode == "cfg" else GuidanceChoice(guided, 1.0, cfg_scale)
    g = _number("guidance", g)
    if not np.isfinite(g) or g < 0:
        raise InvalidArgumentError.about("{0}={g} must be a finite number >= 0", "guidance", g=g)
    if mode == "embedded":
        return GuidanceChoice(guided, g, cfg_scale)
    if g <= 1.0:  # as diffusers' pipelines (guidance_scale > 1 turns it on): turbo cards pass 0.0
        return GuidanceChoice(False, 1.0, 1.0)
    why = family.guidance_error(pipe, values)
    if why:
        raise InvalidArgumentError.about("{0}={g} {why}", "guidance", g=g, why=why)
    return GuidanceChoice(True, g, g)


def initial_noise(pipe: ArgumentView, n: int, noise: Any, shape: tuple[int, ...]) -> np.ndarray:
    """The user's initial noise in the pipeline's layout -> NHWC float32 (n, H, W, C)."""
    try:
        arr = np.asarray(noise, dtype=np.float32)
    except (TypeError, ValueError):
        raise InvalidArgumentError("noise must be an array of floats", argument="noise") from None
    h, w, c = shape
    want = (n, c, h, w) if pipe.layout == "NCHW" else (n, h, w, c)
    if arr.shape != want:
        raise InvalidArgumentError(f"noise has shape {arr.shape}, expected {want} ({pipe.layout}, n={n})",
                                   argument="noise")
    return arr.transpose(0, 2, 3, 1) if pipe.layout == "NCHW" else arr


def seeds_for(n: int, seed: int | Sequence[int]) -> np.ndarray:
    """Per-image uint32 seeds: ``seed + i`` from an int, or one given per image."""
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        seeds = [int(seed) + i for i in range(n)]
    elif isinstance(seed, (list, tuple, np.ndarray)):
        try:
            seeds = [int(s) for s in seed]
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"seed={seed!r} must be an int or a list of ints", argument="seed") from None
        if len(seeds) != n:
            raise InvalidArgumentError(f"got {len(seeds)} seeds for n={n}; give one int or one per image", argument="seed")
    else:
        raise InvalidArgumentError(f"seed={seed!r} must be an int or a list of ints", argument="seed")
    if any(not 0 <= s < 2**32 for s in seeds):
        raise InvalidArgumentError(f"seeds must be in [0, 2**32); got {min(seeds)}..{max(seeds)}", argument="seed")
    return np.asarray(seeds, np.uint32)


def images(pixels: np.ndarray) -> list:
    """uint8 pixels (n, H, W, C) -> PIL images (L, RGB or RGBA by channel count)."""
    from PIL import Image

    mode = {1: "L", 3: "RGB", 4: "RGBA"}.get(pixels.shape[-1])
    if mode is None:
        raise InvalidArgumentError(f"cannot make images from {pixels.shape[-1]} channels; use generate() for arrays")
    return [Image.fromarray(p[..., 0] if mode == "L" else p, mode) for p in pixels]


def concat(pipe: ArgumentView, requests: Sequence[Request], pad: int = 0) -> Request:
    """Requests that share a batch key (one program, the same per-call values) -> one Request of
    their images, then ``pad`` copies of the first image (a batch bucket's padding). Nothing is
    validated again: per-image values (each declared ``per_image`` input, the seeds, each image's
    LoRAs) are concatenated; every other value is the first request's (equal by the key)."""
    first = requests[0]
    per_image = {s.name for s in pipe.family.input_specs(pipe) if s.per_image}

    def joined(parts: list[Any]) -> Any:
        if isinstance(parts[0], np.ndarray):
            out = np.concatenate(parts)
            return np.concatenate([out, np.repeat(out[:1], pad, axis=0)]) if pad else out
        out = [v for p in parts for v in p]
        return out + out[:1] * pad

    values = {k: (joined([r.values[k] for r in requests]) if k in per_image and v is not None else v)
              for k, v in first.values.items()}
    n = sum(r.n for r in requests) + pad
    seeds = np.concatenate([*(r.seeds for r in requests), np.zeros(pad, np.uint32)])
    noise = None if first.noise is None else joined([r.noise for r in requests])
    lora = None
    if first.lora is not None:  # each image's adapters, re-slotted for the whole batch (files already read)
        from preheat.lora import parse_request

        adapters = [list(r.lora.slots[int(i)]) for r in requests for i in r.lora.index]
        lora = parse_request(pipe, n, adapters + adapters[:1] * pad, None)
    return dataclasses.replace(first, n=n, seeds=seeds, noise=noise, values=values, lora=lora)
