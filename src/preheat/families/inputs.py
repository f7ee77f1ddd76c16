"""Declared inputs: each family says once what it takes, and every surface derives its view.

An :class:`InputSpec` is one keyword of ``Pipeline.generate``: its name, its type (one of the
small frozen types below, which carry the bounds and choices), whether it is given per image or
per call, whether it is *static* (a new value selects another compiled program, like a size) or
*data*, its default, the values warm-up must compile, and a one-line description; a
``scheduler_key`` input sets that key of the folder's scheduler config for the call, a ``plan_key``
input is passed to the schedule (``make_plan``) as ``set_timesteps`` would be given it. A family lists
its specs in ``Family.specs``; ``Family.input_specs(pipe)`` resolves what depends on the loaded
model (a native size, a size multiple, class names). The common inputs every family takes
(n, steps, sampler, ...) are :data:`COMMON_SPECS`.

    type      Python value                       normalised to        JSON schema
    --------  ---------------------------------  -------------------  -----------------------
    Text      str (per image: str or n strs)     str / list[str]      string, maxLength
    Int       int in [low, high], a multiple     int                  integer, min/max
    Float     finite number in [low, high]       float                number, min/max
    Bool      True / False                       bool                 boolean
    Choice    one of ``options``                 str                  string, enum
    Pair      two non-negative ints              (int, int)           array of 2 integers
    Ints      ints in [low, high] (a list)       tuple[int, ...]      array of integers
    Label     a class index or label name        int (per image)      integer or enum string
    Image     PIL image, uint8 array, path, bytes  uint8 (H, W, 3)      string (URL or data URI)
              (``mask``: one channel, white = repaint)  (H, W)

What a deployment offers of them (``--inputs``, ``--input-values``) and what warm-up compiles is
``preheat.families.offer``'s.

The image size is one concept, two static inputs: :data:`IMAGE_SIZE` (a :class:`SizePair`) names
them once, :func:`size_specs` declares them, and a surface asks :func:`size_pair` for them (OpenAI's
``size="WxH"``, the served-size enum) instead of comparing names.

The image inputs every image-conditioned family declares (``IMAGE``, ``MASK_IMAGE``, ``STRENGTH``;
diffusers' names) live once in ``preheat.families.image``, so that the surfaces' field names and
flags (Cog's ``image`` / ``mask``, ``--image`` / ``--mask`` / ``--strength``) are the same for every
family; an ``Image`` spec's warm value :data:`WARM_IMAGE` is a placeholder of each served size.

A new type is one more class with ``check`` (value -> normalised, or a one-line
``InvalidArgumentError`` naming the input, built by ``about`` so that each surface words it with its
own name for the input), ``schema``, ``from_text`` (a command-line value; the text itself unless the
type overrides it); a server's pydantic field is ``preheat.server.inputs``' reading of the type. Surfaces read only these fields: none tests a family's kind by its
input names.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from preheat.env import FALSE_VALUES, TRUE_VALUES
from preheat.errors import InvalidArgumentError

__all__ = ["InputSpec", "CliForm", "Text", "Int", "Float", "Bool", "Choice", "Pair", "Ints", "Label", "Image",
           "COMMON_SPECS", "common_spec", "SizePair", "IMAGE_SIZE", "size_pair",
           "check_int", "unknown_input", "size_specs", "example_inputs", "typed_flags", "field_of",
           "check_needs", "WARM_IMAGE", "SURFACES", "SEED_MAX", "ServerBound"]


def check_int(name: str, value: Any, low: int, high: int | None = None, what: str = "") -> int:
    """An int in [low, high], or a one-line InvalidArgumentError naming ``name``."""
    bound = f"an int in [{low}, {high}]" if high is not None else ("a positive int" if low == 1 else f"an int >= {low}")
    if not _ints_within((value,), low, high):
        raise InvalidArgumentError.about("{0}={value!r} must be {bound}{what}", name, value=value, bound=bound, what=what)
    return int(value)


def _ints_within(items: Sequence[Any], low: int, high: int | None) -> bool:
    """Whether every item is an int (not a bool) in [low, high] (None: unbounded)."""
    return all(not isinstance(v, bool) and isinstance(v, (int, np.integer)) and v >= low
               and (high is None or v <= high) for v in items)


def _int_schema(low: int, high: int | None) -> dict[str, Any]:
    """The JSON schema of an int in [low, high] (None: unbounded)."""
    return {"type": "integer", "minimum": low, **({} if high is None else {"maximum": high})}


def _from_text(name: str, text: str, parse: Any, what: str) -> Any:
    """``parse(text)``, or a one-line InvalidArgumentError naming ``name``: it ``must be {what}``."""
    try:
        return parse(text)
    except ValueError:
        raise InvalidArgumentError(f"{name} {text!r} must be {what}", argument=name) from None


# ------------------------------------------------------------------------------------ types


class _Typed:
    """What every input type shares: a command-line value is the text itself unless the type says otherwise."""

    def from_text(self, name: str, text: str) -> Any:
        return text


@dataclass(frozen=True)
class Text(_Typed):
    """A string (a prompt)."""

    max_length: int = 2000

    def check(self, name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise InvalidArgumentError.about("{0} must be a string or a list of strings, not {kind}", name,
                                             kind=type(value).__name__)
        if len(value) > self.max_length:
            raise InvalidArgumentError.about("{0} has {count} characters; at most {most}", name, count=len(value),
                                             most=self.max_length)
        return value

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "maxLength": self.max_length}


@dataclass(frozen=True)
class Int(_Typed):
    """An int in [low, high] (None: unbounded), a multiple of ``multiple``."""

    low: int = 0
    high: int | None = None
    multiple: int = 1

    def check(self, name: str, value: Any) -> int:
        if self.low == self.high and value != self.low:
            raise InvalidArgumentError.about("{0}={value!r}: this model makes {0} {low} only", name, value=value,
                                             low=self.low)
        value = check_int(name, value, self.low, self.high)
        if value % self.multiple:
            raise InvalidArgumentError.about("{0}={value} must be a multiple of {multiple} for this model", name,
                                             value=value, multiple=self.multiple)
        return value

    def schema(self) -> dict[str, Any]:
        return {**_int_schema(self.low, self.high), **({"multipleOf": self.multiple} if self.multiple > 1 else {})}

    def from_text(self, name: str, text: str) -> int:
        return _from_text(name, text, int, "an int")


@dataclass(frozen=True)
class Float(_Typed):
    """A finite number in [low, high] (None: unbounded); ``low_open``: low itself is refused,
    (low, high] (img2img's strength: 0 would denoise nothing)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def check(self, name: str, value: Any) -> float:
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise InvalidArgumentError.about("{0}={value!r} must be a number", name, value=value) from None
        if isinstance(value, bool) or not math.isfinite(f) or (self.low is not None and (
                f < self.low or (self.low_open and f == self.low))) or (self.high is not None and f > self.high):
            raise InvalidArgumentError.about("{0}={value!r} must be a finite number{bounds}", name, value=value,
                                             bounds=self._bounds())
        return f

    def _bounds(self) -> str:
        if self.low is not None and self.high is not None:
            return f" in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        low = f" {'>' if self.low_open else '>='} {self.low:g}" if self.low is not None else ""
        return low or (f" <= {self.high:g}" if self.high is not None else "")

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "number"}
        if self.low is not None:
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            out["maximum"] = self.high
        return out

    def from_text(self, name: str, text: str) -> float:
        return _from_text(name, text, float, "a number")


@dataclass(frozen=True)
class Bool(_Typed):
    """A switch (ControlNet's guess_mode): True or False, never a number or a string that looks like one."""


    def check(self, name: str, value: Any) -> bool:
        if not isinstance(value, (bool, np.bool_)):
            raise InvalidArgumentError.about("{0}={value!r} must be true or false", name, value=value)
        return bool(value)

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean"}

    def from_text(self, name: str, text: str) -> bool:
        if text.lower() not in TRUE_VALUES + FALSE_VALUES:
            raise InvalidArgumentError(f"{name} {text!r} must be true or false", argument=name)
        return text.lower() in TRUE_VALUES


@dataclass(frozen=True)
class Choice(_Typed):
    """One of ``options`` (strings)."""

    options: tuple[str, ...]

    def check(self, name: str, value: Any) -> str:
        if value not in self.options:
            raise InvalidArgumentError.about("{0}={value!r} is not one of: {options}", name, value=value,
                                             options=", ".join(self.options))
        return str(value)

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "enum": list(self.options)}


@dataclass(frozen=True)
class Pair(_Typed):
    """Two ints in [low, high] (SDXL's (height, width) micro-conditioning)."""

    low: int = 0
    high: int | None = None

    def check(self, name: str, value: Any) -> tuple[int, int]:
        if not isinstance(value, (list, tuple)) or len(value) != 2 or not _ints_within(value, self.low, self.high):
            raise InvalidArgumentError.about("{0} must be two non-negative ints (height, width), got {value!r}", name,
                                             value=value)
        return int(value[0]), int(value[1])

    def schema(self) -> dict[str, Any]:
        return {"type": "array", "items": _int_schema(self.low, self.high), "minItems": 2, "maxItems": 2}

    def from_text(self, name: str, text: str) -> tuple[int, int]:
        """"1024,768" (or 1024x768) -> (1024, 768)."""
        def two(text: str) -> tuple[int, int]:
            first, second = (int(p) for p in text.replace("x", ",").split(","))
            return first, second

        return _from_text(name, text, two, "two ints, e.g. 1024,768")


@dataclass(frozen=True)
class Ints(_Typed):
    """One or more ints in [low, high] (a scheduler's custom timesteps); a tuple, so a surface's
    batch key can hold it."""

    low: int = 0
    high: int | None = None

    def check(self, name: str, value: Any) -> tuple[int, ...]:
        items = list(value) if isinstance(value, (list, tuple, np.ndarray)) else None
        if not items or not _ints_within(items, self.low, self.high):
            bound = f"in [{self.low}, {self.high}]" if self.high is not None else f">= {self.low}"
            raise InvalidArgumentError.about("{0} must be a list of one or more ints {bound}, got {value!r}", name,
                                             bound=bound, value=value)
        return tuple(int(v) for v in items)

    def schema(self) -> dict[str, Any]:
        return {"type": "array", "items": _int_schema(self.low, self.high), "minItems": 1}

    def from_text(self, name: str, text: str) -> tuple[int, ...]:
        """"999,499" -> (999, 499)."""
        return _from_text(name, text, lambda t: tuple(int(p) for p in t.split(",")),
                          "ints separated by commas, e.g. 999,499")


@dataclass(frozen=True)
class Label(_Typed):
    """A class of a class-conditional model: its index, or its label name (``count`` None: the
    model is unconditional and takes none)."""

    count: int | None
    names: tuple[str, ...] = ()

    def check(self, name: str, value: Any) -> int:
        if self.count is None:
            raise InvalidArgumentError.about("{0} given, but this model is not class-conditional", name)
        if isinstance(value, str):
            if value in self.names:
                return self.names.index(value)
            digits = value.strip().lstrip("-")
            if not (digits.isascii() and digits.isdigit()):  # ASCII digits only: not "٧" or "７
                known = ", ".join(self.names) or f"0..{self.count - 1}"
                # each surface names the input its own way (class_label=..., --class=...)
                raise InvalidArgumentError.about("{0}={value!r} is not a class of this model; known classes: {known}",
                                                 name, value=value, known=known)
            value = int(value)
        if not _ints_within((value,), 0, self.count - 1):
            shown = int(value) if isinstance(value, np.integer) else value  # 12, not np.int64(12)
            raise InvalidArgumentError.about("{0}={value!r} is not a class of this model; classes are 0..{last}", name,
                                             value=shown, last=self.count - 1)
        return int(value)

    def schema(self) -> dict[str, Any]:
        if self.count is None:
            return {"not": {}}
        names = list(self.names) or [str(i) for i in range(self.count)]
        return {"anyOf": [_int_schema(0, self.count - 1), {"type": "string", "enum": names}]}


@dataclass(frozen=True)
class Image(_Typed):
    """An image a call passes in (img2img's init image, an inpainting mask, a Kontext reference):
    read and checked by ``preheat.image_input.read_image`` (formats, size limit before decoding,
    EXIF orientation, RGB / one-channel conversion). A server fetches a URL or decodes a data URI
    to bytes before this check (``preheat.server.fetch``); the CLI passes a path."""

    mask: bool = False

    def check(self, name: str, value: Any) -> np.ndarray:
        from preheat.image_input import read_image

        return read_image(value, name, mask=self.mask)

    def schema(self) -> dict[str, Any]:
        return {"type": "string", "format": "uri"}  # the CLI's text: a path, which read_image reads

    def placeholder(self, width: int, height: int) -> np.ndarray:
        """What warm-up passes for :data:`WARM_IMAGE` at a served size: its content is data, its
        size selects the program (mid grey; a mask all white: repaint everything)."""
        return np.full((height, width), 255, np.uint8) if self.mask else np.full((height, width, 3), 128, np.uint8)


InputType = Text | Int | Float | Bool | Choice | Pair | Ints | Label | Image


# ------------------------------------------------------------------------------------ the spec


def _lora_from_cli(text: str) -> Any:
    """``--lora SRC[:SCALE]`` -> (source, scale) (``preheat.lora`` is imported only when one is given)."""
    from preheat.lora import parse_cli

    return parse_cli(text)


@dataclass(frozen=True)
class CliForm:
    """An input's own command-line syntax, where its type's ``from_text`` is not it: the flag is
    repeated (one value each), shown as ``metavar``, and each text becomes a ``generate`` value by
    ``parse`` (the LoRA's ``--lora SRC[:SCALE]``: the LoRAs used together and their scales)."""

    metavar: str  # what --help shows after the flag
    parse: Any  # Callable[[str], Any]: one given text -> one item of the generate value (a list)

# Where an input can be given: ``pipe(...)``, ``preheat sample``'s flags, a server's input fields
# (Cog's ``POST /predictions``, the OpenAI routes and the Runpod handler share one parse).
SURFACES: tuple[str, ...] = ("python", "cli", "server")


class ServerBound(enum.Enum):
    """Which of a server's limits narrows an input beyond its declared type (``InputSpec.bound``),
    so that the OpenAPI document states the real bounds; ``preheat.server.inputs.Limits.bounds``
    says each one's values."""

    BATCH = enum.auto()  # at most the largest batch (``--max-batch-size``)
    STEPS = enum.auto()  # at most ``--max-steps``
    GUIDANCE = enum.auto()  # at most the server's max guidance scale
    SEED = enum.auto()  # leaves room for seed + i across the largest batch
    LORA_SCALE = enum.auto()  # within [-max, max] of the server's LoRA scale


@dataclass(frozen=True)
class InputSpec:
    """One declared input of ``Pipeline.generate`` (see the module docstring)."""

    name: str
    type: InputType
    description: str  # one line: the CLI's --help, the OpenAPI description
    per_image: bool = False  # one value per image (a list of n), or one value for all of them
    static: bool = False  # a new value selects another compiled program (part of the batching key)
    default: Any = None  # None: absent (optional), or the family fills it in (``default_doc`` says how)
    required: bool = False
    warm: tuple[Any, ...] = ()  # the values warm-up compiles (static inputs; () = the default only)
    field: str | None = None  # its name in Cog / OpenAI / Runpod inputs, where that differs
    aliases: tuple[str, ...] = ()  # other surface fields that may carry it (a class model's "prompt": a class name)
    flag: str | None = None  # its command-line flag, where that is not --name-with-dashes
    needs_guidance: bool = False  # refused unless classifier-free guidance runs (a negative prompt)
    needs: tuple[str, ...] = ()  # refused unless these inputs are given too (a mask needs its image)
    offered_by_default: bool = True  # an optional input a server offers (and warms) unless --inputs leaves it
    #   out; False: only when --inputs names it (FLUX.1's negative prompt: its true-CFG programs, rarely used)
    default_doc: str = ""  # what an absent value means, when ``default`` cannot say it
    example: Any = None  # a realistic value (a bench's prompt); None: the first warm value
    scheduler_key: bool = False  # a key of the folder's scheduler config this call overrides, as a card's
    #   ``Class.from_config(config, key=value)`` does (``preheat.families.request.scheduler_config``)
    plan_key: bool = False  # a keyword of ``preheat.samplers.make_plan`` (what a pipeline passes to
    #   ``set_timesteps``: a card's custom ``timesteps=[800]``; ``preheat.families.request.plan``)
    counts_steps: bool = False  # a list whose length is the step count (diffusers' set_timesteps(timesteps=)
    #   sets num_inference_steps = len(timesteps)): the steps when a call gives none; other steps are refused
    surfaces: tuple[str, ...] = SURFACES  # the surfaces that take it (``noise``, an array: Python only)
    docs: tuple[tuple[str, str], ...] = ()  # (surface, its text) where a surface words it otherwise: its own
    #   default (the server's random seed, the CLI's seed 0) or its own syntax (the CLI's --lora SRC[:SCALE])
    cli_form: CliForm | None = None  # a command-line syntax of its own (repeated, parsed by its CliForm)
    bound: ServerBound | None = None  # the server limit that narrows it (n: the largest batch); None: its type's
    defaults: tuple[tuple[str, Any], ...] = ()  # (surface, its default) where a surface's is not ``default``
    #   (a server's one image per request and random seed)

    def describe(self, surface: str) -> str:
        """The one-line text ``surface`` shows (--help, the OpenAPI description)."""
        return dict(self.docs).get(surface, self.description)

    def default_on(self, surface: str) -> Any:
        """Its default on ``surface`` (``defaults``), else the declared ``default``."""
        return dict(self.defaults).get(surface, self.default)

    @property
    def surface_name(self) -> str:
        """The Cog / OpenAI / Runpod field name."""
        return self.field or self.name

    @property
    def cli_flag(self) -> str:
        """The ``preheat sample`` flag (repeat it for one value per image)."""
        return self.flag or "--" + self.name.replace("_", "-")

    def check(self, value: Any, n: int) -> Any:
        """A given value -> its normalised form (per image: a list of n); absent -> the default
        (None when optional), or a one-line error naming the input when required."""
        if value is None:
            if self.required:
                what = "a string or one string per image" if isinstance(self.type, Text) and self.per_image else \
                    "an image (this model takes one on every call)" if isinstance(self.type, Image) else "a value"
                raise InvalidArgumentError.about("{0} is required: {what}", self.name, what=what)
            value = self.default
            if value is None:
                return None
        if not self.per_image:
            return self.type.check(self.name, value)
        if isinstance(value, (list, tuple, np.ndarray)) and not isinstance(self.type, Pair):
            items = list(value)
            if len(items) != n:
                plural = self.name if self.name.endswith("s") else f"{self.name}s"
                give = "one string or one per image" if isinstance(self.type, Text) else "one per image or one for all"
                raise InvalidArgumentError.about("got {count} {plural} for {1}={n}; give {give}", self.name,
                                                 "n", count=len(items), plural=plural, n=n, give=give)
            return [self.type.check(self.name, v) for v in items]
        return [self.type.check(self.name, value)] * n

    def schema(self) -> dict[str, Any]:
        """Its JSON schema (one value: a surface takes one value per request for all its images)."""
        out = {**self.type.schema(), "description": self.description}
        if self.default is not None and not isinstance(self.default, tuple):
            out["default"] = self.default
        return out


def unknown_input(family: str, specs: Sequence[InputSpec], inputs: dict[str, Any]) -> None:
    """A one-line error naming the first given keyword that no spec declares."""
    names = {s.name for s in specs}
    unknown = sorted(k for k, v in inputs.items() if v is not None and k not in names)
    if unknown:
        accepted = ", ".join(s.name for s in specs) or "none"
        raise InvalidArgumentError(f"unexpected argument {unknown[0]!r} for a {family} model; its inputs are: "
                                   f"{accepted}", argument=unknown[0])


# ------------------------------------------------------------------------------------ common

SEED_MAX = 2**32 - 1

# In the order the surfaces list them (the server's x-order, the CLI's --help).
COMMON_SPECS: tuple[InputSpec, ...] = (
    InputSpec("n", Int(1), "Number of images.", field="num_outputs", default_doc="1 per prompt, 16 for class models",
              docs=(("cli", "Number of images (default: 16 for class models, 1 for text-to-image)."),),
              bound=ServerBound.BATCH, defaults=(("server", 1),)),  # a request makes one image unless it asks
    InputSpec("steps", Int(1), "Denoising steps (the model's default when absent).", field="num_inference_steps",
              docs=(("cli", "Denoising steps (default: the model's)."),), bound=ServerBound.STEPS),
    InputSpec("guidance", Float(0.0), "Classifier-free guidance scale; 1 = off (the model's default when absent).",
              field="guidance_scale", docs=(("cli", "Classifier-free guidance scale (1 = off)."),),
              bound=ServerBound.GUIDANCE),
    InputSpec("sampler", Choice(()), "Sampler (the model's default when absent).", static=True, field="scheduler",
              docs=(("cli", "(default: the model's)."),)),  # the CLI's help lists the samplers before it
    InputSpec("seed", Int(0, SEED_MAX), "Image i uses seed + i (or one seed per image).", default=0,
              docs=(("cli", "Image i uses seed + i."), ("server", "Image i uses seed + i; random when absent.")),
              bound=ServerBound.SEED, defaults=(("server", None),)),  # a random seed, which the response reports
    InputSpec("noise", Float(), "The initial noise, (n, C, H, W) floats (replaces the seeds' draw).",
              surfaces=("python",)),
    InputSpec("eta", Float(0.0), "Stochasticity: DDIM's eta, TCD's gamma.", default=0.0),
    InputSpec("lora", Text(), "A LoRA: a safetensors path, http(s):// or hf://org/repo[/file.safetensors].",
              field="lora_weights", flag="--lora", cli_form=CliForm("SRC[:SCALE]", _lora_from_cli), docs=(
                  ("server", "A LoRA: a safetensors path, http(s):// or hf://org/repo[/file.safetensors]. "
                             "Empty = none."),
                  ("cli", "A LoRA (path, http(s)://, hf://org/repo/file) and its scale (default 1); repeat to "
                          "combine."))),
    # the CLI gives a LoRA's scale inside --lora SRC[:SCALE], one per LoRA: an error about it names --lora
    InputSpec("lora_scale", Float(), "How strongly the LoRA applies.", default=1.0, surfaces=("python", "server"),
              flag="--lora", bound=ServerBound.LORA_SCALE),
)


def common_spec(name: str) -> InputSpec:
    """One of :data:`COMMON_SPECS` by its keyword (a KeyError for none)."""
    return {spec.name: spec for spec in COMMON_SPECS}[name]


class SizePair(NamedTuple):
    """The image size: two static inputs that act as one (width, height). It is declared once,
    here (:data:`IMAGE_SIZE`, which :func:`size_specs` declares its two specs by), and a surface
    asks for it -- :func:`size_pair` of its specs, or :data:`IMAGE_SIZE` where it holds no specs
    (a bench's or warm-up's size) -- rather than naming its inputs: OpenAI's ``size="WxH"``, a
    server's served-size enum, the playground's size <select>, a tiny random model's default size.
    Its two keys are whatever the surface keys by (``generate`` keywords, which are also the server's
    fields and diffusers' keywords; or the CLI's flags, ``cli.family_options.size_flags()``)."""

    width: str  # the key of the width in pixels
    height: str  # the key of the height in pixels

    def inputs(self, size: tuple[int, int]) -> dict[str, int]:
        """(width, height) -> its two keys' values."""
        return {self.width: size[0], self.height: size[1]}

    def of(self, values: Mapping[str, Any]) -> tuple[int, int] | None:
        """The (width, height) ``values`` hold; None unless they hold both."""
        if values.get(self.width) is None or values.get(self.height) is None:
            return None
        return values[self.width], values[self.height]

    def given(self, values: Mapping[str, Any]) -> bool:
        """Whether ``values`` give either side (a caller's size then wins over any default)."""
        return values.get(self.width) is not None or values.get(self.height) is not None

    def without(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` less the size (a surface that states the size its own way: OpenAI's ``size``)."""
        return {k: v for k, v in values.items() if k not in self}


IMAGE_SIZE = SizePair("width", "height")  # diffusers' keywords; every family's size is these two inputs


def size_specs(width: int, height: int, multiple: int, high: int | None, *, fixed: bool = False) -> tuple[InputSpec, ...]:
    """width and height as static ints: the native size by default, a multiple of what the latent
    grid needs (``fixed``: the model makes its native size only)."""
    def one(name: str, native: int) -> InputSpec:
        kind = Int(native, native) if fixed else Int(multiple, high, multiple)
        default = f"the model's {native}" if native else "the model's native size"  # 0: the CLI's model-free help
        return InputSpec(name, kind, f"Image {name} in pixels ({default} when absent).", static=True,
                         default=native)

    return one(IMAGE_SIZE.width, width), one(IMAGE_SIZE.height, height)


def size_pair(specs: Sequence[InputSpec]) -> SizePair | None:
    """The image size the ``specs`` declare (:func:`size_specs`'s two static inputs), or None when
    they declare none: what a surface asks for instead of looking for a "width" among the names."""
    static = {s.name for s in specs if s.static}
    return IMAGE_SIZE if all(key in static for key in IMAGE_SIZE) else None


def check_needs(specs: Sequence[InputSpec], given: dict[str, Any], values: dict[str, Any]) -> None:
    """The relations between a call's ``given`` inputs (``values``: as checked): each given spec's
    ``needs`` are given too, and a mask has the size of the image it needs (``Image(mask=True)``).
    One-line errors naming the dependent input."""
    for spec in specs:
        if given.get(spec.name) is None:
            continue
        for other in spec.needs:
            if given.get(other) is None:
                raise InvalidArgumentError.about("{0} needs {1}; give both", spec.name, other)
            mine, theirs = values[spec.name], values[other]
            if isinstance(spec.type, Image) and spec.type.mask and isinstance(mine, np.ndarray) and \
                    isinstance(theirs, np.ndarray) and mine.shape[:2] != theirs.shape[:2]:
                raise InvalidArgumentError.about("{0} is {mine} but {1} is {theirs}; they must be the same size",
                                                 spec.name, other, mine=f"{mine.shape[1]}x{mine.shape[0]}",
                                                 theirs=f"{theirs.shape[1]}x{theirs.shape[0]}")


def example_inputs(specs: Sequence[InputSpec]) -> dict[str, Any]:
    """A call's required inputs at their example values (what a benchmark draws): keyword -> value."""
    return {s.name: s.example if s.example is not None else s.warm[0] for s in specs if s.required}


def typed_flags(declared: Sequence[InputSpec], family: str, flags: dict[str, list[str]]) -> dict[str, Any]:
    """Command-line flags (flag -> its texts, as given) as ``generate`` keywords, typed by the
    ``declared`` specs of ``family`` (one value for all images, or a list: one per image). A flag
    no spec declares for the CLI fails naming those that are."""
    specs = {s.cli_flag: s for s in declared if "cli" in s.surfaces}
    values: dict[str, Any] = {}
    for flag, texts in flags.items():
        spec = specs.get(flag)
        if spec is None:
            takes = ", ".join(specs) or "none"
            raise InvalidArgumentError(f"{flag} does not apply to a {family} model; its inputs are: {takes}",
                                       argument=flag)
        typed = [spec.type.from_text(flag, t) for t in texts]
        if len(typed) > 1 and not spec.per_image:
            raise InvalidArgumentError(f"{flag} is given {len(typed)} times; it takes one value", argument=flag)
        values[spec.name] = typed if len(typed) > 1 else typed[0]
    return values


def field_of(specs: Sequence[InputSpec]) -> dict[str, str]:
    """keyword -> surface field, for mapping an error's ``argument`` back to the field a client sent."""
    return {s.name: s.surface_name for s in specs}


WARM_IMAGE = "placeholder"  # an Image spec's warm value: ``Image.placeholder`` at each served size
