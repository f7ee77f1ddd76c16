"""What a server offers of a family's declared inputs, and what warm-up compiles of them.

The declarations are ``preheat.families.inputs``'; this module reads them for a deployment: the
optional data inputs a server may offer or leave out (``--inputs``: :func:`optional_inputs`,
:func:`default_offered`, :func:`offered_specs`, :func:`check_offered`), the static inputs besides
the size and the values a server serves of each (``--input-values``: :func:`static_inputs`,
:func:`served_values`, :func:`check_input_values`), how a call's size, those inputs and its sampler
are served (:func:`served_size`, :func:`served_statics`, :func:`served_sampler`), and the data variants warm-up passes
(:func:`warm_variants`). ``preheat.warm`` enumerates programs from these, and ``preheat.server``
refuses what they leave out, so the two agree.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from preheat.errors import InvalidArgumentError
from preheat.families.inputs import IMAGE_SIZE, InputSpec, SizePair, size_pair

__all__ = ["warm_variants", "NO_INPUTS", "optional_inputs", "default_offered", "inputs_offering", "required_inputs",
           "offered_specs", "parse_offered", "check_offered", "static_inputs", "served_values", "check_input_values",
           "ServedStatics", "served_statics", "ServedSize", "served_size", "ServedSampler", "served_sampler"]


def warm_variants(specs: Sequence[InputSpec], guided: bool) -> list[dict[str, Any]]:
    """The data inputs warm-up passes, one dict per program variant: each spec's first ``warm``
    value, then every other one (None: the input left out) -- a ``needs_guidance`` input only
    when ``guided``. Static inputs (sizes) are the caller's: they come from the served set."""
    variants: list[dict[str, Any]] = [{}]
    for spec in specs:
        if spec.static or not spec.warm:
            continue
        values = spec.warm if guided or not spec.needs_guidance else spec.warm[:1]
        variants = [{**v, spec.name: value} for v in variants for value in values]
    needs = {s.name: s.needs for s in specs}
    out: list[dict[str, Any]] = []
    for variant in variants:
        given = {k: v for k, v in variant.items() if v is not None}
        # an input whose needs are absent is left out (a mask or a strength without an image)
        given = {k: v for k, v in given.items() if all(other in given for other in needs.get(k, ()))}
        if given not in out and all(s.name in given for s in specs if s.required and s.warm and not s.static):
            out.append(given)
    return out


NO_INPUTS = "none"  # ``--inputs none``: only the required inputs (a text-only server)


def optional_inputs(specs: Sequence[InputSpec]) -> tuple[str, ...]:
    """The inputs a server may offer or not: the optional data inputs that warm-up compiles both
    left out and given (``None`` among their ``warm`` values: a negative prompt, an image, a mask),
    each its own programs. Required inputs are always offered; the others (a strength, a crop) go
    with the inputs they need (``offered_specs``)."""
    return tuple(s.name for s in specs if not s.required and not s.static and None in s.warm)


def default_offered(specs: Sequence[InputSpec]) -> tuple[str, ...]:
    """The optional inputs a server offers when ``--inputs`` is not given: every one but those
    declared ``offered_by_default=False``."""
    by_name = {s.name: s for s in specs}
    return tuple(name for name in optional_inputs(specs) if by_name[name].offered_by_default)


def inputs_offering(specs: Sequence[InputSpec], offered: Iterable[str], spec: InputSpec) -> str:
    """The ``--inputs`` value that offers ``spec`` beside the ``offered`` ones: those, ``spec``
    (or the input it goes with) and what it needs, in declaration order -- what a refusal of an
    input that is not offered tells the user to declare (the server's and ``cache explain``'s)."""
    wanted = {*offered, spec.name, *spec.needs}
    return ",".join(name for name in optional_inputs(specs) if name in wanted)


def required_inputs(specs: Sequence[InputSpec]) -> tuple[str, ...]:
    """The data inputs every call gives (a prompt, Kontext's reference): always offered."""
    return tuple(s.name for s in specs if s.required and not s.static)


def offered_specs(specs: Sequence[InputSpec], offered: Sequence[str] | None) -> tuple[InputSpec, ...]:
    """The specs a server offering ``offered`` (of :func:`optional_inputs`; None: the
    :func:`default_offered` ones) takes: the others left out, and with them every input that needs
    one left out (an image's strength, a mask's crop), in declaration order."""
    if offered is None:
        offered = default_offered(specs)
    dropped = {name for name in optional_inputs(specs) if name not in offered}
    while True:  # needs may chain (a crop needs the mask, which needs the image)
        more = {s.name for s in specs if s.name not in dropped and any(n in dropped for n in s.needs)}
        if not more:
            return tuple(s for s in specs if s.name not in dropped)
        dropped |= more


def parse_offered(text: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``--inputs`` / ``PREHEAT_INPUTS`` -> the offered names (``none``: ()), None when not given.
    The names are checked against a family once its model is known (:func:`check_offered`)."""
    if text is None:
        return None
    items = text.split(",") if isinstance(text, str) else list(text)
    names = tuple(dict.fromkeys(str(v).strip() for v in items if str(v).strip()))
    return () if names == (NO_INPUTS,) else names


def check_offered(family: str, specs: Sequence[InputSpec], offered: Sequence[str] | None,
                  label: str = "--inputs") -> tuple[str, ...]:
    """The offered optional inputs (None: the :func:`default_offered` ones), in declaration order; a
    name that is not one of them, or one offered without an input it needs, fails in one line
    listing what the family declares and naming ``label``, what the user gave them by (``--inputs``,
    Runpod's ``PREHEAT_INPUTS``)."""
    optional = optional_inputs(specs)
    if offered is None:
        return default_offered(specs)
    required = required_inputs(specs)
    always = f"; {', '.join(required)} always offered" if required else ""
    declared = f"its optional inputs are {', '.join(optional)} (or {NO_INPUTS})" if optional else \
        f"it has no optional inputs (give {NO_INPUTS}, or leave {label} out)"
    for name in offered:
        if name == NO_INPUTS:
            raise InvalidArgumentError(f"{label} {NO_INPUTS} stands alone: it offers only the required inputs"
                                       f"{always}", argument="inputs")
        if name not in optional:
            raise InvalidArgumentError(f"{label} {name!r} is not an optional input of a {family} model: {declared}"
                                       f"{always}", argument="inputs")
    by_name = {s.name: s for s in specs}
    for name in offered:
        missing = [n for n in by_name[name].needs if n in optional and n not in offered]
        if missing:
            raise InvalidArgumentError(f"{label} {name} needs {', '.join(missing)}; offer both", argument="inputs")
    return tuple(n for n in optional if n in offered)


def static_inputs(specs: Sequence[InputSpec]) -> tuple[InputSpec, ...]:
    """The static inputs besides the image size (which ``--sizes`` serves): each value another
    program, so a server serves the values it warmed (``--input-values``; a T5 prompt's length)."""
    pair = size_pair(specs)
    return tuple(s for s in specs if s.static and (pair is None or s.name not in pair))


def served_values(spec: InputSpec, input_values: Sequence[tuple[str, tuple[Any, ...]]]) -> tuple[Any, ...]:
    """The values a server of ``input_values`` (checked: :func:`check_input_values`) serves of the
    static input ``spec``, the first what a request without it gets: those named, else its ``warm``
    values, else its default."""
    return dict(input_values).get(spec.name) or spec.warm or (spec.default,)


def check_input_values(family: str, specs: Sequence[InputSpec], given: Sequence[tuple[str, tuple[Any, ...]]],
                       label: str = "--input-values") -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """``--input-values`` (name -> values, text or typed) checked against a family's declaration:
    each name one of its :func:`static_inputs`, each value typed and checked by its spec, in
    declaration order; otherwise one line naming ``label`` and what the family declares."""
    static = {s.name: s for s in static_inputs(specs)}
    declared = f"its static inputs are: {', '.join(static)}" if static else "it has none besides the size"
    out = {}
    for name, values in given:
        spec = static.get(name)
        if spec is None:
            sizes = " (the size is served by --sizes)" if name in IMAGE_SIZE else ""
            raise InvalidArgumentError(f"{label} {name!r} is not a static input of a {family} model{sizes}; "
                                       f"{declared}", argument="input_values")
        typed = []
        for value in values:
            try:
                typed.append(spec.check(spec.type.from_text(name, value) if isinstance(value, str) else value, 1))
            except InvalidArgumentError as err:
                raise InvalidArgumentError(f"{label} {err}", argument="input_values") from None
        out[name] = tuple(dict.fromkeys(typed))
    return tuple((name, out[name]) for name in static if name in out)


class ServedStatics(NamedTuple):
    """A call's static inputs besides the size as a server serves them (:func:`served_statics`)."""

    filled: dict[str, Any]  # absent ones the declaration names: keyword -> its first served value
    refused: list[tuple[InputSpec, str]]  # given values it does not serve: (the input, why, one line)


def served_statics(specs: Sequence[InputSpec], input_values: Sequence[tuple[str, tuple[Any, ...]]],
                   values: Mapping[str, Any]) -> ServedStatics:
    """How a server of ``input_values`` (checked) takes a call's static inputs besides the size:
    one absent but named there gets its first served value (as a request without a size gets the
    first size); a given value it does not serve is refused, naming the ``--input-values`` that
    would serve it. The server's parse and ``cache explain --as-server`` read this one rule."""
    filled: dict[str, Any] = {}
    refused: list[tuple[InputSpec, str]] = []
    for spec in static_inputs(specs):
        served = served_values(spec, input_values)
        value = values.get(spec.name)
        if value is None:
            if spec.name in dict(input_values):
                filled[spec.name] = served[0]
        elif value not in served:
            wanted = f"{spec.name}={','.join(map(str, (*served, value)))}"
            refused.append((spec, f"{value} is not served here (another program); served: "
                                  f"{', '.join(map(str, served))} (start the server with --input-values {wanted}, or "
                                  f"PREHEAT_INPUT_VALUES={wanted}, to serve it)"))
    return ServedStatics(filled, refused)


class ServedSize(NamedTuple):
    """A call's (width, height) as a server of some sizes serves it (:func:`served_size`)."""

    size: tuple[int, int]
    refused: str | None  # the key (a SizePair's) of the side to name when the size is not served; None: served
    why: str  # that one line ("" when served)


def served_size(pair: SizePair, values: Mapping[str, Any], served: Sequence[tuple[int, int]]) -> ServedSize:
    """How a server of the ``served`` sizes (the first its default) takes a call's size: a side not
    given is the first size's; a size it does not serve is refused, naming the side off every served
    size (else the height) and listing the sizes. The server's parse and ``cache explain --as-server``
    read this one rule."""
    size = (values.get(pair.width, served[0][0]), values.get(pair.height, served[0][1]))
    if size in served:
        return ServedSize(size, None, "")
    allowed = ", ".join(f"{w}x{h}" for w, h in served)
    wrong = pair.width if pair.width in values and size[0] not in {w for w, _ in served} else pair.height
    return ServedSize(size, wrong, f"{size[0]}x{size[1]} is not served here; sizes: {allowed}")


class ServedSampler(NamedTuple):
    """A call's sampler as a server of some samplers serves it (:func:`served_sampler`)."""

    sampler: str
    refused: str  # why it is not served, one line ("" when it is)


def served_sampler(asked: str | None, model_default: str, served: Sequence[str]) -> ServedSampler:
    """How a server of the ``served`` samplers (``--samplers``; () = every one) takes a call's: one
    naming none gets the model's own when served, else the first served (``--samplers euler`` on a
    dpm++ model answers a bare request with euler, as warmed, rather than refusing it); one it does
    not serve is refused. The server's parse and ``cache explain --as-server`` read this one rule."""
    sampler = asked or (model_default if model_default in served or not served else served[0])
    if served and sampler not in served:
        return ServedSampler(sampler, f"{sampler!r} is not served here; choose one of {', '.join(served)}")
    return ServedSampler(sampler, "")
