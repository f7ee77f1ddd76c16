"""Request parsing, written once: a Cog-style ``input`` dict -> a validated :class:`Job`.

Every surface goes through :func:`parse_input`: the HTTP server (Cog's ``POST /predictions``
and the OpenAI route, which first rewrites its body into the same input fields) and the
Runpod handler. Two layers:

1. the schema: :func:`input_model`, the common inputs bounded by the server's limits, so the
   OpenAPI document states the real bounds (``num_outputs <= max_batch_size`` ...), and
   :func:`family_model`, the served family's declared inputs (``Family.input_specs``: a new
   input of a family is a new field here with no code of its own);
2. the model checks (:func:`parse_input`): served sizes, and the engine's own ``Pipeline.check``
   (which raises one-line ``InvalidArgumentError`` / ``SchedulerConfigError``), mapped back to
   the input field by the error's ``argument`` (:func:`surface_fields`), never by its text.

Image inputs (``Image`` specs: img2img's ``image``, inpainting's ``mask``) are http(s) URLs or
``data:`` URIs. A URL is fetched through the server's one guarded fetch (``Limits.fetcher``,
``Fetcher.image``: address policy, deadline, size cap, per-host slots, nothing stored) --
``Core.parse_async`` fetches them first, off the event loop, and hands the bytes in as
``fetched``; any other string (a path) is refused, so that a client never makes the server read
its own disk. The job keeps a digest of the decoded pixels, not the pixels: equal images share
a batch key, and a retry of the same request is the same job.

Both raise :class:`preheat.errors.InputError`, which carries ``(field, message)`` pairs; surfaces turn it into
HTTP 422 (naming the field) or a Runpod ``{"error": ...}``.
"""

from __future__ import annotations

import functools
import secrets
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal, Mapping, NamedTuple, Optional, Union

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, create_model

from preheat.errors import InputError, InvalidArgumentError, SchedulerConfigError
from preheat.families.inputs import (COMMON_SPECS, IMAGE_SIZE, SEED_MAX, Bool, Choice, Float, Image, InputSpec, Int,
                                     Ints, Label, Pair, ServerBound, Text, field_of, size_pair)
from preheat.families.offer import (default_offered, inputs_offering, offered_specs, served_sampler, served_size,
                                    served_statics)

__all__ = ["Limits", "Job", "FamilyInputs", "family_inputs", "input_model", "family_model", "parse_input", "served_sizes", "surface_fields", "offered",
           "OUTPUT_FORMATS", "SEED_MAX", "JsonInt", "json_int", "JsonFloat",
           "image_urls", "served_specs", "served_type"]

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
    inputs: Optional[tuple[str, ...]] = None  # the optional data inputs offered (WarmSet.inputs); None: all
    input_values: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # static inputs' served values (WarmSet.input_values)
    max_lora_scale: float = MAX_LORA_SCALE  # lora_scale within [-max, max]
    lora_dir: Optional[str] = None  # local LoRA files only from under this folder; None: URLs and hf:// only
    fetcher: Any = None  # server.fetch.Fetcher: every URL a request names goes through it; None: a default one

    def bounds(self, bound: ServerBound) -> tuple[Optional[float], Optional[float]]:
        """(low, high) of an input that ``bound`` narrows (``InputSpec.bound``); None: no bound of the server's."""
        return self._bounds[bound]

    @functools.cached_property
    def _bounds(self) -> dict[ServerBound, tuple[Optional[float], Optional[float]]]:
        """Every bound's (low, high), built once per Limits (the schema asks for each input's;
        ``replace`` makes a new Limits, with its own)."""
        return {ServerBound.BATCH: (None, self.max_batch_size), ServerBound.STEPS: (None, self.max_steps),
                ServerBound.GUIDANCE: (None, self.max_guidance),
                ServerBound.SEED: (None, SEED_MAX - (self.max_batch_size - 1)),  # room for seed + i
                ServerBound.LORA_SCALE: (-self.max_lora_scale, self.max_lora_scale)}


@dataclass(frozen=True)
class Job:
    """One validated request, in engine terms. ``seeds`` are per image: image i uses ``seed + i``."""

    n: int
    seed: int
    sampler: str
    steps: int
    guidance: Optional[float]  # resolved scale; None or 1.0 = no classifier-free guidance
    output_format: str = "png"
    eta: float = 0.0  # DDIM's eta / TCD's gamma: one value per call (the schedule's), so part of the batch key
    # the family's inputs as ``Pipeline.generate`` keywords, sorted by name: a per-image one as a
    # tuple of n values, a per-call one as its value (width, height, SDXL's size pairs)
    values: tuple[tuple[str, Any], ...] = ()
    per_image: frozenset[str] = frozenset()  # which of ``values`` are per image
    lora: Optional[tuple[Any, float]] = None  # (preheat.lora.LoraFile, scale): read and checked at parse time
    lora_bucket: Optional[int] = None  # its rank bucket: one program per bucket, any LoRA of it shares a batch
    request: Any = field(default=None, compare=False, repr=False)  # the engine's validated Request (the worker's)

    @property
    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.n)]

    @property
    def size(self) -> Optional[tuple[int, int]]:
        """(width, height) as served, when the family takes them."""
        return IMAGE_SIZE.of(dict(self.values))

    @property
    def batch_key(self) -> tuple:
        """Requests with equal keys can share one engine call (the same programs and the same
        per-call values): the sampler, steps, guidance, eta, every per-call input (static ones like the
        size select the program; data ones are one value per call), which per-image inputs are
        given (SDXL's unconditional branch is zeros without negative prompts: another encode
        batch), and the LoRA rank bucket."""
        per_call = tuple((k, v) for k, v in self.values if k not in self.per_image)
        return (self.sampler, self.steps, self.guidance, per_call, tuple(sorted(self.per_image)), self.lora_bucket,
                self.eta)

    def engine_inputs(self) -> dict[str, Any]:
        """This job's family inputs, as ``Pipeline.generate`` keywords (per-image ones as lists; a
        LoRA per image, so that jobs with different LoRAs of one bucket share an engine call)."""
        out: dict[str, Any] = {k: list(v) if k in self.per_image else v for k, v in self.values}
        if self.lora is not None:
            out["lora"] = [[self.lora]] * self.n
        return out


def _all_samplers() -> tuple[str, ...]:
    # before set-up the model is not known; once it is, Limits.schedulers holds what is served
    # (its family's samplers, which the engine's check names when a request asks for another)
    from preheat.samplers import SAMPLERS

    return tuple(SAMPLERS)


X_ORDER = 20  # Cog's field order hint of the first common input (the family's inputs come first)


def served_specs() -> tuple[InputSpec, ...]:
    """The common inputs a server takes (``"server"`` in their ``surfaces``), in their declared order."""
    return tuple(s for s in COMMON_SPECS if "server" in s.surfaces)


def _narrowed(kind: Any, low: Any, high: Any) -> Any:
    """An Int / Float type within [low, high] as well as its own bounds (None: no bound of the server's)."""
    def tighter(mine: Any, theirs: Any, pick: Any) -> Any:
        return theirs if mine is None else mine if theirs is None else pick(mine, theirs)

    return replace(kind, low=tighter(kind.low, low, max), high=tighter(kind.high, high, min))


def served_type(spec: InputSpec, limits: Limits) -> Any:
    """An input's type on this server: its declared bounds within the server limit its
    declaration names (``InputSpec.bound``: ``Limits.bounds``), so that the OpenAPI document states
    the real ones (``num_outputs <= max_batch_size``, a seed that leaves room for seed + i, the
    samplers served)."""
    if isinstance(spec.type, Choice) and not spec.type.options:  # the sampler: what this server serves
        return Choice(tuple(limits.schedulers or _all_samplers()))
    if spec.bound is not None and isinstance(spec.type, (Int, Float)):
        return _narrowed(spec.type, *limits.bounds(spec.bound))
    return spec.type


def input_model(limits: Limits) -> type[BaseModel]:
    """The pydantic model of Cog's ``input`` object for these limits: the common inputs
    (``COMMON_SPECS`` a server takes, typed by :func:`served_type`, described as for the
    ``"server"`` surface) and the server's own ``output_format``. The served family's inputs
    are extra fields, checked by :func:`family_model` once the model is known (and named in the
    OpenAPI document then); any other field is refused."""
    formats = limits.output_formats or OUTPUT_FORMATS
    fields: dict[str, Any] = {}
    specs = served_specs()
    for order, spec in enumerate(specs, X_ORDER):
        default = spec.default_on("server")  # one image, a random seed: where a request's is not Python's
        annotation = _annotation(replace(spec, type=served_type(spec, limits)))
        fields[spec.surface_name] = (annotation if default is not None else Optional[annotation],
                                     Field(default, json_schema_extra={"x-order": order},
                                           description=spec.describe("server")))
    fields["output_format"] = (Literal[tuple(formats)], Field(  # type: ignore[misc]
        formats[0], json_schema_extra={"x-order": X_ORDER + len(specs)}, description="Image encoding of the data URLs."))
    return create_model("Input", __config__=ConfigDict(extra="allow"), **fields)


def _annotation(spec: InputSpec) -> Any:
    """A spec's type as a pydantic annotation (one value per request: a surface's images share it)."""
    t = spec.type
    if isinstance(t, Text):
        return Annotated[str, Field(max_length=t.max_length)]
    if isinstance(t, Int):
        return json_int(t.low, t.high if t.high is not None else 2**31 - 1)
    if isinstance(t, Float):
        low = {"gt" if t.low_open else "ge": t.low}
        return Annotated[float, Field(**low, le=t.high, allow_inf_nan=False), BeforeValidator(_json_number)]
    if isinstance(t, Bool):
        return StrictBool  # JSON true / false
    if isinstance(t, Choice):
        return Literal[tuple(t.options)]  # type: ignore[misc]
    if isinstance(t, Pair):
        return tuple[JsonInt, JsonInt]
    if isinstance(t, Ints):
        return Annotated[tuple[json_int(t.low, t.high if t.high is not None else 2**31 - 1), ...],  # type: ignore[misc]
                         Field(min_length=1)]
    if isinstance(t, Label):
        return Union[JsonInt, str]
    if isinstance(t, Image):
        return str  # an http(s) URL or a data: URI (the body's size limit bounds it)
    raise TypeError(f"no surface type for {type(t).__name__}")


@functools.lru_cache(maxsize=8)
def family_model(specs: tuple[InputSpec, ...]) -> type[BaseModel]:
    """The pydantic model of a family's inputs a server takes (``"server"`` in their surfaces), by
    their surface names (all optional here: a required one is refused by its spec, naming it);
    unknown fields are refused."""
    specs = tuple(s for s in specs if "server" in s.surfaces)
    fields: dict[str, Any] = {s.surface_name: (Optional[_annotation(s)], Field(None, description=s.describe("server")))
                              for s in specs}
    for s in specs:
        for alias in s.aliases:
            fields.setdefault(alias, (Optional[str], Field(None, description=s.description)))
    return create_model("FamilyInput", __config__=ConfigDict(extra="forbid"), **fields)


def _field_of(loc: tuple) -> str:
    parts = [str(p) for p in loc if not isinstance(p, int)]
    return parts[0] if parts else "input"


def validation_errors(err: ValidationError) -> list[tuple[str, str]]:
    return [(_field_of(e.get("loc", ())), e.get("msg", "invalid")) for e in err.errors()]


def surface_fields(specs: tuple[InputSpec, ...]) -> dict[str, str]:
    """``Pipeline.generate`` keyword -> the input field a client sends (the common inputs and the
    family's): where an error's ``argument`` points. Errors are never matched on their text."""
    return {**field_of(COMMON_SPECS), **field_of(specs)}


def _error_field(err: Exception, fields: dict[str, str], aliased: dict[str, str]) -> str:
    argument = getattr(err, "argument", None)
    if argument in aliased:
        return aliased[argument]
    if argument in fields:
        return fields[argument]
    return fields.get("sampler", "input") if isinstance(err, SchedulerConfigError) else "input"


def served_sizes(pipe: Any, limits: Limits) -> tuple[tuple[int, int], ...]:
    """(width, height) pairs a request may ask for: the served sizes, or the model's own size."""
    return tuple(limits.sizes) or pipe.family.served_sizes(pipe)


class FamilyInputs(NamedTuple):
    """The served family's inputs, as one request reads them (:func:`family_inputs`, once per
    request, passed down): what it declares, and what this server offers of that."""

    declared: tuple[InputSpec, ...]  # ``Family.input_specs(pipe)``, in declaration order
    offered: tuple[InputSpec, ...]  # ``declared`` less what ``Limits.inputs`` leaves out (and what needs it)


def family_inputs(pipe: Any, limits: Limits) -> FamilyInputs:
    """The family's declared inputs and those this server offers (:class:`FamilyInputs`), each
    typed as served (:func:`served_type`: FLUX.1's true_cfg_scale within the server's guidance limit)."""
    declared = tuple(replace(s, type=served_type(s, limits)) for s in pipe.family.input_specs(pipe))
    return FamilyInputs(declared, offered_specs(declared, limits.inputs))


def offered(pipe: Any, limits: Limits) -> tuple[InputSpec, ...]:
    """The family's inputs this server takes: its declaration less the optional inputs it does
    not offer (``Limits.inputs``) and what needs them; every surface's fields and schema are these."""
    return family_inputs(pipe, limits).offered


def _not_offered(inputs: FamilyInputs, limits: Limits, extra: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A request's fields that name a declared input this server does not offer: (field, one line
    naming it by the field the client sent and the ``--inputs`` that would offer it)."""
    declared = inputs.declared
    served = {s.name for s in inputs.offered}
    errors = []
    for spec in declared:
        if spec.name in served:
            continue
        sent = next((f for f in (spec.surface_name, *spec.aliases) if extra.get(f) is not None), None)
        if sent is None:
            continue
        offering = default_offered(declared) if limits.inputs is None else limits.inputs
        names = inputs_offering(declared, offering, spec)
        errors.append((sent, f"{sent} is not served here (start the server with --inputs {names}, or "
                             f"PREHEAT_INPUTS={names}, to offer it)"))
    return errors


def image_urls(specs: tuple[InputSpec, ...], raw: Any) -> dict[str, str]:
    """The image fields of a raw input that name an http(s) URL: field -> URL (what to fetch)."""
    get = raw.get if isinstance(raw, Mapping) else (lambda name: (getattr(raw, "model_extra", None) or {}).get(name))
    out = {}
    for spec in specs:
        value = get(spec.surface_name) if isinstance(spec.type, Image) else None
        if isinstance(value, str) and value.strip().lower().startswith(("http://", "https://")):
            out[spec.surface_name] = value.strip()
    return out


def _image_value(spec: InputSpec, value: str, fetched: Mapping[str, bytes], limits: Limits) -> Any:
    """An image field's string -> what ``Image.check`` reads: a URL's bytes (fetched before, or
    now through the guarded fetch), a data URI as it is. Anything else is refused: a server
    reads no path a client names."""
    from preheat.errors import PreheatError

    text = value.strip()
    if text.lower().startswith(("http://", "https://")):
        if text in fetched:
            return fetched[text]
        from preheat.server.fetch import default_fetcher

        try:
            return (limits.fetcher if limits.fetcher is not None else default_fetcher()).image(text)
        except PreheatError as err:
            raise InvalidArgumentError((str(err).splitlines() or [type(err).__name__])[0], argument=spec.name) from None
    if text.startswith("data:"):
        return text
    raise InvalidArgumentError(f"{spec.surface_name} must be an http(s) URL or a data: URI "
                               "(data:image/png;base64,...)", argument=spec.name)


def _image_digest(pixels: np.ndarray) -> str:
    """A decoded image as a job holds it: its size and a hash of its pixels."""
    import hashlib

    return f"{'x'.join(map(str, pixels.shape))}:{hashlib.sha256(np.ascontiguousarray(pixels)).hexdigest()}"


def _family_values(pipe: Any, inputs: FamilyInputs, extra: dict[str, Any], limits: Limits,
                   errors: list[tuple[str, str]],
                   fetched: Mapping[str, bytes] = {}) -> tuple[dict[str, Any], dict[str, str]]:
    """The family's inputs a request gave (by surface name) -> ``generate`` keywords, and which
    came through an alias (keyword -> that field). Sizes must be served ones; images are bytes
    or data URIs (:func:`_image_value`)."""
    refused = _not_offered(inputs, limits, extra)
    if refused:
        errors.extend(refused)
        return {}, {}
    specs = inputs.offered
    try:
        given = family_model(specs).model_validate(extra).model_dump(exclude_none=True)
    except ValidationError as err:
        errors.extend(validation_errors(err))
        return {}, {}
    values: dict[str, Any] = {}
    aliased: dict[str, str] = {}
    for spec in specs:
        value = given.get(spec.surface_name)
        for alias in spec.aliases:
            other = given.get(alias)
            if other is None or not other.strip():
                continue
            if value is not None and str(value) != other.strip():
                errors.append((alias, f"names {other.strip()!r}, but {spec.surface_name} is {value!r}"))
            elif value is None:
                value, aliased[spec.name] = other.strip(), alias
        if value is not None and isinstance(spec.type, Image):
            try:
                value = _image_value(spec, value, fetched, limits)
            except InvalidArgumentError as err:
                errors.append((spec.surface_name, str(err)))
                continue
        if value is not None:
            values[spec.name] = value
    pair = size_pair(specs)
    if pair is not None:
        call = served_size(pair, values, served_sizes(pipe, limits))
        if call.refused is not None:
            errors.append((field_of(specs)[call.refused], call.why))
        values.update(pair.inputs(call.size))
    statics = served_statics(specs, limits.input_values, values)  # any other static input: its warmed values only
    values.update(statics.filled)
    errors.extend((spec.surface_name, why) for spec, why in statics.refused)
    return values, aliased


def _per_image(values: Any) -> tuple:
    """A normalised per-image value (a list, or an array of class indices) as a tuple of plain values."""
    return tuple(np.asarray(values).tolist()) if isinstance(values, np.ndarray) else tuple(values)


def parse_input(raw: Any, pipe: Any, limits: Limits, model: type[BaseModel] | None = None,
                fetched: Mapping[str, bytes] = {}, inputs: FamilyInputs | None = None) -> tuple[Job, dict[str, Any]]:
    """Validate a Cog-style input (a dict or an instance of :func:`input_model`) against the limits
    and the loaded pipeline (``fetched``: image URLs already read, URL -> bytes; ``inputs``: the
    family's inputs, when the caller has read them for this request already). Returns the job
    and the input as given (unset fields left out)."""
    model = model or input_model(limits)
    inputs = inputs if inputs is not None else family_inputs(pipe, limits)
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
    extra = dict(values.model_extra or {})
    errors: list[tuple[str, str]] = []
    n = v["num_outputs"]
    family, aliased = _family_values(pipe, inputs, extra, limits, errors, fetched)

    seed = v["seed"]
    if seed is None:
        seed = secrets.randbelow(2**31)
    elif seed + n - 1 > SEED_MAX:
        errors.append(("seed", f"seed + num_outputs - 1 must be <= {SEED_MAX} (image i uses seed + i)"))

    sampler, refused = served_sampler(v["scheduler"], pipe.defaults["sampler"], limits.schedulers or _all_samplers())
    if refused:
        errors.append(("scheduler", refused))
    steps = v["num_inference_steps"]  # None: the engine's (the model's default, or the custom timesteps' count)
    guidance = v["guidance_scale"] if v["guidance_scale"] is not None else pipe.defaults.get("guidance")
    lora, lora_bucket = _lora(pipe, v, errors, limits.lora_dir, limits.fetcher)
    if errors:
        raise InputError(errors)

    specs = inputs.offered
    per_call = {k: v for k, v in family.items() if not any(s.name == k and s.per_image for s in specs)}
    per_image = {k: [v] * n for k, v in family.items() if k not in per_call}
    job = Job(n=n, seed=int(seed), sampler=sampler, steps=0, guidance=guidance, eta=float(v["eta"]),  # steps: below
              output_format=v["output_format"], lora=lora, lora_bucket=lora_bucket,
              values=tuple(sorted({**per_call, **per_image}.items())), per_image=frozenset(per_image))
    try:  # the engine's own host-side checks (guidance without a null class, schedule, sizes, ...)
        request = pipe.check(n, steps=steps, sampler=sampler, guidance=guidance, seed=job.seeds, eta=job.eta,
                             **job.engine_inputs())
    except (InvalidArgumentError, SchedulerConfigError) as err:
        fields = {**surface_fields(specs), **aliased}  # the message names each input by the field a client sent
        raise InputError([(_error_field(err, fields, aliased), err.renamed(fields))], source=err,
                         fields=fields) from None
    if steps is None and request.steps > limits.max_steps:  # a default the server's max does not allow
        counted = next((s for s in specs if s.counts_steps and request.values.get(s.name) is not None), None)
        field_name, what = (counted.surface_name, f"{counted.surface_name} has {request.steps} entries") \
            if counted is not None else ("num_inference_steps", f"the model default {request.steps}")
        raise InputError([(field_name, f"{what}: more steps than this server's max {limits.max_steps}")])
    # every per-image input as the engine resolved it for this request alone (a class tour, a
    # prompt_2 that is the prompt): the job's images stay the same whatever shares their batch
    resolved = {s.name: _per_image(request.values[s.name]) for s in specs
                if s.per_image and request.values.get(s.name) is not None}
    per_call.update({s.name: _image_digest(request.values[s.name]) for s in specs
                     if isinstance(s.type, Image) and s.name in per_call})
    job = replace(job, steps=request.steps, values=tuple(sorted({**per_call, **resolved}.items())),
                  per_image=frozenset(resolved), request=request)
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

    runtime = pipe.lora_runtime
    if runtime is None:
        errors.append(("lora_weights", f"LoRAs are not supported for a {pipe.family.name} model"))
        return None, None
    from preheat.server.fetch import Fetcher, default_fetcher
    from preheat.store import is_remote

    try:
        if is_remote(source) and not Fetcher.stored(source):  # not yet fetched (Core.parse_async fetches first)
            (fetcher if fetcher is not None else default_fetcher()).lora(source)
        lora = runtime.file(source)
        bucket = runtime.bucket_for(lora.rank)
    except PreheatError as err:
        errors.append(("lora_weights", (str(err).splitlines() or [type(err).__name__])[0]))
        return None, None
    except (OSError, RuntimeError, ValueError) as err:  # a file the safetensors reader itself refuses
        errors.append(("lora_weights", f"cannot read {source}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"))
        return None, None
    return (lora, float(v["lora_scale"])), bucket
