"""Request parsing, written once: a Cog-style ``input`` dict -> a validated :class:`Job`.

Every surface goes through :func:`parse_input`: the HTTP server (Cog's ``POST /predictions``
and the OpenAI route, which first rewrites its body into the same input fields) and the
Runpod handler. Two layers:

1. the schema (:func:`input_model`): a pydantic model built from the server's limits, so the
   OpenAPI document states the real bounds (``num_outputs <= max_batch_size`` ...);
2. the model checks (:func:`parse_input`): class names, image size, LoRA sources, and the
   engine's own host-side ``Pipeline.check`` (which raises one-line ``InvalidArgumentError`` /
   ``SchedulerConfigError``), mapped back to the input field that caused them.

Both raise :class:`preheat.errors.InputError`, which carries ``(field, message)`` pairs; surfaces turn it into
HTTP 422 (naming the field) or a Runpod ``{"error": ...}``.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from dataclasses import dataclass, replace
from typing import Annotated, Any, Callable, Literal, Mapping, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from preheat.errors import InputError, InvalidArgumentError, SchedulerConfigError

__all__ = ["Limits", "Job", "input_model", "parse_input", "OUTPUT_FORMATS", "SEED_MAX", "JsonInt", "json_int",
           "parse_sizes", "parse_lora_ranks", "JsonFloat"]

SEED_MAX = 2**32 - 1
MAX_LORA_SCALE = 4.0
OUTPUT_FORMATS: tuple[str, ...] = ("png", "webp", "jpg")


def _json_integer(value: Any) -> Any:
    """JSON Schema's "integer": 2 and 2.0 yes; true, "2" and 2.5 no (pydantic's lax int takes them)."""
    if isinstance(value, (bool, str, bytes)):
        raise ValueError("Input should be a valid integer")
    return value


JsonInt = Annotated[int, BeforeValidator(_json_integer)]


def _json_number(value: Any) -> Any:
    """JSON Schema's "number": 3 and 3.5 yes; true and "3" no (pydantic's lax float takes them).
    The one coercion rule for every numeric field: a number is a JSON number, never a string or bool."""
    if isinstance(value, (bool, str, bytes)):
        raise ValueError("Input should be a valid number")
    return value


JsonFloat = Annotated[float, BeforeValidator(_json_number)]


def json_int(ge: int, le: int) -> Any:
    """JsonInt within [ge, le], with the bounds in the JSON schema (minimum/maximum)."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_json_integer)]


@dataclass(frozen=True)
class Limits:
    """What a server accepts (also what its OpenAPI schema advertises)."""

    max_batch_size: int = 8  # also the largest num_outputs of one request
    max_steps: int = 200
    max_guidance: float = 50.0
    schedulers: tuple[str, ...] = ()  # allowed sampler names; () = every sampler preheat has
    output_formats: tuple[str, ...] = OUTPUT_FORMATS
    sizes: tuple[tuple[int, int], ...] = ()  # text-to-image: served (width, height); () = the model's default
    max_lora_scale: float = MAX_LORA_SCALE  # lora_scale within [-max, max]
    lora_dir: Optional[str] = None  # local LoRA files only from under this folder; None: URLs and hf:// only
    fetcher: Any = None  # server.fetch.Fetcher: every URL a request names goes through it; None: a default one


@dataclass(frozen=True)
class Job:
    """One validated request, in engine terms. ``seeds`` are per image: image i uses ``seed + i``."""

    n: int
    labels: Optional[tuple[int, ...]]  # one class index per image; None for unconditional / text models
    seed: int
    sampler: str
    steps: int
    guidance: Optional[float]  # resolved scale; None or 1.0 = no classifier-free guidance
    output_format: str = "png"
    prompts: Optional[tuple[str, ...]] = None  # text-to-image: one prompt per image
    negative_prompts: Optional[tuple[str, ...]] = None  # text-to-image, guided only
    size: Optional[tuple[int, int]] = None  # text-to-image: (width, height), static (one program each)
    lora: Optional[tuple[Any, float]] = None  # (preheat.lora.LoraFile, scale): read and checked at parse time
    lora_bucket: Optional[int] = None  # its rank bucket: one program per bucket, any LoRA of it shares a batch

    @property
    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.n)]

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys can share one engine call (same programs and same runtime scalars).
        Whether negative prompts are given is part of it: SDXL's unconditional branch is zeros
        without them (a different text-encoding batch), the encoded negatives with them."""
        return (self.sampler, self.steps, self.guidance, self.size, self.negative_prompts is not None,
                self.lora_bucket)

    def engine_inputs(self) -> dict[str, Any]:
        """This job's per-image family inputs, as ``Pipeline.generate`` keywords (a LoRA per image,
        so that jobs with different LoRAs of one bucket share an engine call)."""
        out: dict[str, Any] = {}
        if self.prompts is not None:
            out["prompt"] = list(self.prompts)
            if self.negative_prompts is not None:
                out["negative_prompt"] = list(self.negative_prompts)
        elif self.labels is not None:
            out["class_labels"] = list(self.labels)
        if self.lora is not None:
            out["lora"] = [[self.lora]] * self.n
        return out


def _all_samplers() -> tuple[str, ...]:
    # before set-up the model is not known; once it is, Limits.schedulers holds what is served
    # (its family's samplers, which the engine's check names when a request asks for another)
    from preheat.samplers import SAMPLERS

    return tuple(SAMPLERS)


def input_model(limits: Limits) -> type[BaseModel]:
    """The pydantic model of Cog's ``input`` object for these limits (unknown fields are refused)."""
    schedulers = limits.schedulers or _all_samplers()
    formats = limits.output_formats or OUTPUT_FORMATS

    def order(i: int, **extra: Any) -> dict[str, Any]:
        return {"x-order": i, **extra}  # Cog's field order hint

    fields: dict[str, Any] = {
        "prompt": (Optional[str], Field(None, max_length=2000, json_schema_extra=order(0),
                                        description="Text-to-image models: the prompt. Class-conditional models: "
                                                    "a class name or index, e.g. \"7\".")),
        "negative_prompt": (Optional[str], Field(None, max_length=2000, json_schema_extra=order(1),
                                                 description="Text-to-image models: what to steer away from "
                                                             "(needs guidance).")),
        "class_label": (Optional[Union[JsonInt, str]], Field(None, json_schema_extra=order(1),
                                                               description="Class index or label (class-conditional models).")),
        "num_outputs": (json_int(1, limits.max_batch_size), Field(1, json_schema_extra=order(2),
                                         description="Number of images.")),
        "num_inference_steps": (Optional[json_int(1, limits.max_steps)], Field(None, json_schema_extra=order(3),
                                                           description="Denoising steps (model default when absent).")),
        "guidance_scale": (Optional[JsonFloat], Field(None, ge=0, le=limits.max_guidance, allow_inf_nan=False,
                                                  json_schema_extra=order(4),
                                                  description="Classifier-free guidance scale; 1 = off (model default when absent).")),
        "scheduler": (Optional[Literal[tuple(schedulers)]], Field(None, json_schema_extra=order(5),  # type: ignore[misc]
                                                                   description="Sampler (model default when absent).")),
        "seed": (Optional[json_int(0, SEED_MAX - (limits.max_batch_size - 1))], Field(None, json_schema_extra=order(6),
                                            description="Image i uses seed + i; random when absent.")),
        "width": (Optional[json_int(1, 65536)], Field(None, json_schema_extra=order(7),
                                             description="Must equal the model's width when given.")),
        "height": (Optional[json_int(1, 65536)], Field(None, json_schema_extra=order(8),
                                              description="Must equal the model's height when given.")),
        "output_format": (Literal[tuple(formats)], Field(formats[0], json_schema_extra=order(9),  # type: ignore[misc]
                                                         description="Image encoding of the data URLs.")),
        "lora_weights": (Optional[str], Field(None, max_length=2000, json_schema_extra=order(10),
                                              description="A LoRA: a safetensors path, http(s):// or hf://org/repo"
                                                          "[/file.safetensors] (diffusers/peft, kohya or BFL names). "
                                                          "Empty = none.")),
        "lora_scale": (JsonFloat, Field(1.0, ge=-limits.max_lora_scale, le=limits.max_lora_scale, allow_inf_nan=False,
                                    json_schema_extra=order(11),
                                    description="How strongly the LoRA applies (ignored without lora_weights).")),
    }
    return create_model("Input", __config__=ConfigDict(extra="forbid"), **fields)


def _field_of(loc: tuple) -> str:
    parts = [str(p) for p in loc if not isinstance(p, int)]
    return parts[0] if parts else "input"


def validation_errors(err: ValidationError) -> list[tuple[str, str]]:
    return [(_field_of(e.get("loc", ())), e.get("msg", "invalid")) for e in err.errors()]


# Pipeline.generate keyword -> Cog input field (InvalidArgumentError.argument names the keyword)
ENGINE_FIELDS = {"steps": "num_inference_steps", "guidance": "guidance_scale", "sampler": "scheduler",
                 "seed": "seed", "class_labels": "class_label", "n": "num_outputs", "prompt": "prompt",
                 "negative_prompt": "negative_prompt", "width": "width", "height": "height", "lora": "lora_weights",
                 "lora_scale": "lora_scale"}


def _engine_field(message: str, is_scheduler_error: bool, argument: Optional[str] = None) -> str:
    """Which input field an engine error is about: its ``argument`` when it names one, else the
    message's first word (scheduler errors name no argument)."""
    if argument in ENGINE_FIELDS:
        return ENGINE_FIELDS[argument]
    if is_scheduler_error or message.startswith("unknown sampler"):
        return "scheduler"
    for prefix, name in (("guidance", "guidance_scale"), ("steps", "num_inference_steps"),
                         ("seed", "seed"), ("got", "class_label"), ("unknown class", "class_label"),
                         ("class_labels", "class_label"), ("n=", "num_outputs")):
        if message.startswith(prefix):
            return name
    return "input"


def _class_from_prompt(pipe: Any, prompt: str) -> int:
    text = prompt.strip()
    lowered = {label.lower(): i for i, label in enumerate(pipe.labels)}
    if text.lower() in lowered:
        return lowered[text.lower()]
    return pipe.class_index(text)


def parse_input(raw: Any, pipe: Any, limits: Limits, model: type[BaseModel] | None = None) -> tuple[Job, dict[str, Any]]:
    """Validate a Cog-style input (a dict or an instance of :func:`input_model`) against the limits
    and the loaded pipeline. Returns the job and the input as given (unset fields left out)."""
    model = model or input_model(limits)
    if isinstance(raw, model):
        values = raw
    else:
        if not isinstance(raw, Mapping):
            raise InputError([("input", "must be a JSON object")])
        try:
            values = model.model_validate(dict(raw))
        except ValidationError as err:
            raise InputError(validation_errors(err)) from None
    given = values.model_dump(exclude_unset=True)
    v = values.model_dump()
    errors: list[tuple[str, str]] = []
    n = v["num_outputs"]

    labels: Optional[tuple[int, ...]] = None
    prompts: Optional[tuple[str, ...]] = None
    negatives: Optional[tuple[str, ...]] = None
    size: Optional[tuple[int, int]] = None
    if "prompt" in pipe.family.inputs:  # text-to-image
        if v["class_label"] is not None:
            errors.append(("class_label", "this model takes a prompt, not a class label"))
        if v["prompt"] is None:
            errors.append(("prompt", "is required for a text-to-image model"))
        prompts = tuple([v["prompt"] or ""] * n)
        if v["negative_prompt"] is not None:
            negatives = tuple([v["negative_prompt"]] * n)
        served = limits.sizes or (default_size(pipe),)
        size = (v["width"] or served[0][0], v["height"] or served[0][1])
        if size not in served:
            allowed = ", ".join(f"{sw}x{sh}" for sw, sh in served)
            field = "width" if v["width"] is not None and v["width"] not in {sw for sw, _ in served} else "height"
            errors.append((field, f"{size[0]}x{size[1]} is not served here; sizes: {allowed}"))
    else:
        h, w = pipe.sample_shape[0], pipe.sample_shape[1]
        if v["width"] is not None and v["width"] != w:
            errors.append(("width", f"must be {w}: the model makes {w}x{h} images"))
        if v["height"] is not None and v["height"] != h:
            errors.append(("height", f"must be {h}: the model makes {w}x{h} images"))
        if v["negative_prompt"] is not None:
            errors.append(("negative_prompt", "this model takes no negative prompt (it has no text encoder)"))
        labels = _class_labels(pipe, v, n, errors)

    seed = v["seed"]
    if seed is None:
        seed = secrets.randbelow(2**31)
    elif seed + n - 1 > SEED_MAX:
        errors.append(("seed", f"seed + num_outputs - 1 must be <= {SEED_MAX} (image i uses seed + i)"))

    sampler = v["scheduler"] or pipe.defaults["sampler"]
    allowed = limits.schedulers or _all_samplers()
    if sampler not in allowed:  # the model's default sampler may be outside the allowed list
        errors.append(("scheduler", f"{sampler!r} is not served here; choose one of {', '.join(allowed)}"))
    steps = v["num_inference_steps"] if v["num_inference_steps"] is not None else pipe.defaults["steps"]
    if v["num_inference_steps"] is None and not 1 <= int(steps) <= limits.max_steps:
        errors.append(("num_inference_steps", f"the model default {steps} exceeds this server's max {limits.max_steps}"))
    guidance = v["guidance_scale"] if v["guidance_scale"] is not None else pipe.defaults.get("guidance")
    lora, lora_bucket = _lora(pipe, v, errors, limits.lora_dir, limits.fetcher)
    if errors:
        raise InputError(errors)

    job = Job(n=n, labels=labels, seed=int(seed), sampler=sampler, steps=int(steps), guidance=guidance,
              output_format=v["output_format"], prompts=prompts, negative_prompts=negatives, size=size,
              lora=lora, lora_bucket=lora_bucket)
    try:  # the engine's own host-side checks (guidance without a null class, schedule, sizes, ...)
        pipe.check(n, steps=int(steps), sampler=sampler, guidance=guidance, seed=job.seeds,
                   **job.engine_inputs(), **size_inputs(job))
    except (InvalidArgumentError, SchedulerConfigError) as err:
        field = _engine_field(str(err), isinstance(err, SchedulerConfigError), getattr(err, "argument", None))
        raise InputError([(field, str(err))]) from None
    if guidance is not None:
        guidance = float(guidance)
        if guidance == 1.0:
            guidance = None  # the same program and the same pixels as "no guidance"
    return replace(job, guidance=guidance), given


def lora_source(source: str, lora_dir: Optional[str]) -> str:
    """A client's ``lora_weights`` as the server may read it: ``http(s)://`` and ``hf://`` as they
    are; a local path only under ``lora_dir`` (relative to it, or absolute inside it), so that a
    client can never make the server read, or probe for, any other file on its disk. Raises
    ``InvalidArgumentError`` (one line) otherwise."""
    if "://" in source:
        scheme = source.split("://", 1)[0].lower()
        if scheme not in ("http", "https", "hf"):
            raise InvalidArgumentError(f"{scheme}:// is not a LoRA source; use http(s)://, hf:// or a file under "
                                       "the server's --lora-dir", argument="lora_weights")
        return source
    if lora_dir is None:
        raise InvalidArgumentError("this server reads no local LoRA files (start it with --lora-dir DIR to serve "
                                   "files under DIR); use http(s):// or hf://", argument="lora_weights")
    bad = next((c for c in source if ord(c) < 32 or 127 <= ord(c) < 160), None)
    if bad is not None:  # NUL would reach the OS as a ValueError; other controls are never a real name
        raise InvalidArgumentError(f"a LoRA path may not hold the control character {bad!r}", argument="lora_weights")
    base = Path(lora_dir).resolve()
    try:  # symlink loops (RuntimeError before Python 3.13, OSError after), names too long, ...
        path = (base / source).resolve()
        if not path.is_relative_to(base):
            raise InvalidArgumentError(f"{source!r} is not under the server's --lora-dir", argument="lora_weights")
        if path.is_dir():
            return str(path)  # a folder holding one .safetensors file (preheat.lora's rule)
        if path.exists() and not path.is_file():
            raise InvalidArgumentError(f"{source!r} is not a regular file", argument="lora_weights")
    except InvalidArgumentError:
        raise
    except (OSError, RuntimeError, ValueError) as err:
        why = getattr(err, "strerror", None) or type(err).__name__
        raise InvalidArgumentError(f"cannot use the LoRA path {source!r}: {why}", argument="lora_weights") from None
    return str(path)


def _lora(pipe: Any, v: dict[str, Any], errors: list[tuple[str, str]], lora_dir: Optional[str] = None,
          fetcher: Any = None) -> tuple[Optional[tuple[Any, float]], Optional[int]]:
    """``lora_weights`` -> ((the file, read through the pipeline's LRU), its scale) and its rank bucket;
    a source the server does not serve (:func:`lora_source`), a URL the fetch refuses
    (``fetcher``, a ``server.fetch.Fetcher``: address policy, deadline, size, slots), or a file that
    is missing, corrupt, or does not fit the model, is an error on ``lora_weights``."""
    source = (v.get("lora_weights") or "").strip()
    if not source:
        return None, None
    try:
        source = lora_source(source, lora_dir)
    except InvalidArgumentError as err:
        errors.append(("lora_weights", str(err)))
        return None, None
    from preheat.errors import PreheatError
    from preheat.lora import bucket_for, cached_file

    targets = pipe.components.get("lora_targets") if hasattr(pipe, "components") else None
    if targets is None:
        errors.append(("lora_weights", f"LoRAs are not supported for a {pipe.family.name} model"))
        return None, None
    from preheat.server.fetch import Fetcher, default_fetcher
    from preheat.store import is_remote

    try:
        if is_remote(source) and not Fetcher.stored(source):  # not yet fetched (Core.parse_async fetches first)
            (fetcher if fetcher is not None else default_fetcher()).lora(source)
        lora = cached_file(pipe, source, targets)
        bucket = bucket_for(lora.rank, sorted(pipe.components.get("lora_buckets", set()).copy()))
    except PreheatError as err:
        errors.append(("lora_weights", (str(err).splitlines() or [type(err).__name__])[0]))
        return None, None
    except (OSError, RuntimeError, ValueError) as err:  # a file the safetensors reader itself refuses
        errors.append(("lora_weights", f"cannot read {source}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"))
        return None, None
    return (lora, float(v["lora_scale"])), bucket


def parse_sizes(text: Optional[str]) -> tuple[tuple[int, int], ...]:
    """``512x512,768x512`` -> ((512, 512), (768, 512)): ``preheat serve --sizes`` and Runpod's
    ``PREHEAT_SIZES``. A malformed entry fails in one line."""
    out = []
    for item in (text or "").split(","):
        item = item.strip().lower()
        if not item:
            continue
        w, sep, h = item.partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or int(w) <= 0 or int(h) <= 0:
            raise InvalidArgumentError(f"--sizes {item!r} must be WIDTHxHEIGHT, e.g. 512x512")
        out.append((int(w), int(h)))
    return tuple(dict.fromkeys(out))


def parse_lora_ranks(text: Optional[str], name: str = "--lora-ranks") -> tuple[int, ...]:
    """``16,32`` -> (16, 32): ``--lora-ranks`` and Runpod's ``PREHEAT_LORA_RANKS`` (that each is a
    rank bucket is ``preheat.lora.check_lora_ranks``'s to say). A malformed entry fails in one line."""
    out = []
    for item in (text or "").split(","):
        item = item.strip()
        if item:
            if not item.isdigit():
                raise InvalidArgumentError(f"{name} {item!r} must be rank buckets, e.g. 16,32")
            out.append(int(item))
    return tuple(dict.fromkeys(out))


def default_size(pipe: Any) -> tuple[int, int]:
    """A text-to-image model's native (width, height)."""
    scale = pipe.components["vae_scale"]
    return pipe.sample_shape[1] * scale, pipe.sample_shape[0] * scale


def size_inputs(job: Job) -> dict[str, int]:
    return {} if job.size is None else {"width": job.size[0], "height": job.size[1]}


def _class_labels(pipe: Any, v: dict[str, Any], n: int, errors: list[tuple[str, str]]) -> Optional[tuple[int, ...]]:
    """Class indices from class_label / prompt (a class name), for pixel models."""
    prompt = v["prompt"] if v["prompt"] is not None and v["prompt"].strip() else None
    if pipe.num_classes is None:
        if v["class_label"] is not None:
            errors.append(("class_label", "this model is not class-conditional"))
        if prompt is not None:
            errors.append(("prompt", "this model takes no prompt (it is unconditional)"))
        return None
    index: Optional[int] = None
    try:
        if v["class_label"] is not None:
            index = pipe.class_index(v["class_label"])
    except InvalidArgumentError as err:
        errors.append(("class_label", str(err)))
    if prompt is not None:
        try:
            from_prompt = _class_from_prompt(pipe, prompt)
            if index is not None and from_prompt != index:
                errors.append(("prompt", f"names class {from_prompt}, but class_label is {index}"))
            index = from_prompt if index is None else index
        except InvalidArgumentError as err:
            errors.append(("prompt", f"{err} (a prompt must name a class)"))
    # No class given: a tour of the classes, fixed per request (not per batch position).
    return tuple([index] * n) if index is not None else tuple(i % pipe.num_classes for i in range(n))
