"""The options every command that loads a model or describes a call shares, built in one place.

``model_options``: ``--dtype`` (a choice), ``--weights-dtype``, ``--variant``, ``--cache``: how a model is loaded
(``sample``, ``cache explain``, ``warm``, ``serve``).

``call_options``: everything that selects the compiled program of one ``preheat sample`` call
(the count, the family's inputs, the sampler and steps, guidance, LoRAs, the backend), with
``sample``'s defaults. The common inputs' options (``--n``, ``--steps``, ``--guidance``,
``--sampler``, ``--seed``, ``--eta``, ``--lora``) are derived from their declarations
(``preheat.families.inputs.COMMON_SPECS`` with ``"cli"`` in their surfaces: flag, type and
bounds, default, help text; an input with a syntax of its own declares it, ``InputSpec.cli_form``),
as a family's own inputs are (``cli.family_options``); the ``preheat bench`` commands take the same
options through :func:`common_option`, with their own defaults. ``preheat sample`` and
``preheat cache explain`` both take exactly these, so that ``explain`` describes the call
``sample`` would make with the same flags. The values arrive as one ``CallOptions``.

Importing this module is cheap: the sampler list for ``--help`` is read only when help is shown.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import click

from preheat.cli.family_options import FLAGS, cli_size_specs, size_flags  # FLAGS: a common keyword -> its flag
from preheat.cli.settings_env import settings_options
from preheat.families.inputs import COMMON_SPECS, IMAGE_SIZE, Choice, Float, InputSpec, Int, common_spec
from preheat.settings import CACHE_LAYERS, DTYPES  # the denoiser dtypes the engine compiles for; cache layers

__all__ = ["DTYPES", "CACHE_LAYERS", "model_options", "call_options", "CallOptions", "FLAGS", "SAMPLER",
           "common_option", "spec_option", "size_options", "renamed_option", "output_options", "echo_result",
           "POSITIVE", "NON_NEGATIVE",
           "POSITIVE_SECONDS"]


# Numeric option types: click refuses a value out of range in one line, before anything runs.
POSITIVE = click.IntRange(min=1)
NON_NEGATIVE = click.FloatRange(min=0)
POSITIVE_SECONDS = click.FloatRange(min=0, min_open=True)


class _SamplerName(click.ParamType):
    """A sampler's name, checked against preheat's samplers when the value is given (they import JAX)."""

    name = "sampler"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> str:
        from preheat.samplers import SAMPLERS

        if value not in SAMPLERS:
            self.fail(f"unknown sampler {value!r}; supported: {', '.join(SAMPLERS)}", param, ctx)
        return str(value)


SAMPLER = _SamplerName()


class _SamplerHelp(click.Option):
    """``--sampler``'s help lists every sampler preheat has, read when help is shown (the list
    lives with the samplers, which import JAX); ``help`` is what follows the list."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tail = self.help or ""

    def get_help_record(self, ctx: click.Context) -> Optional[tuple[str, str]]:
        from preheat.samplers import SAMPLERS

        self.help = f"One of: {', '.join(SAMPLERS)} {self.tail}".strip()
        return super().get_help_record(ctx)


def output_options(default_report: Optional[str] = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The JSON convention of every command: ``--json`` prints the machine-readable result on
    stdout (instead of the table), ``--report FILE`` writes it to FILE. The command receives
    ``json_out`` (the report path) and ``as_json``. ``--json-out FILE``, the old spelling, still
    works for one release, with a deprecation line."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, report: Optional[Path], old_json_out: Optional[Path], **kwargs: Any) -> Any:
            if old_json_out is not None:
                click.echo("warning: --json-out is deprecated; use --report FILE (or --json for stdout)", err=True)
            return fn(*args, json_out=report if report is not None else old_json_out, **kwargs)

        out: Callable[..., Any] = wrapper
        for option in reversed([
            click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout."),
            click.option("--report", type=click.Path(dir_okay=False, path_type=Path), default=default_report,
                         show_default=default_report is not None, help="Write the result as JSON to FILE."),
            click.option("--json-out", "old_json_out", type=click.Path(dir_okay=False, path_type=Path), hidden=True),
        ]):
            out = option(out)
        return out

    return decorate


def echo_result(result: Any, text: str, as_json: bool) -> None:
    """``--json``: the result as JSON on stdout; else the human-readable ``text``."""
    import json

    click.echo(json.dumps(result, indent=2, default=str) if as_json else text)


def model_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--dtype, --weights-dtype, --weights-layers, --variant, --cache, --config, --controlnet, --refiner: how the
    model is loaded (declared with every serving setting: ``preheat.settings``, surface ``load``)."""
    return settings_options("load")(fn)


@dataclass(frozen=True)
class CallOptions:
    """One call's options as the flags gave them (None: the model's default). The family's own
    inputs (``--prompt``, ``--class``, ``--width``, ``--original-size``, ...) are ``flags``, as
    text: the loaded model's declared specs type them (``cli.family_options``)."""

    model: Optional[str]
    flags: dict[str, list[str]]  # family input flag -> its values as given (one per repeat)
    n: Optional[int]
    steps: Optional[int]
    sampler: Optional[str]
    seed: int
    guidance: Optional[float]
    eta: float
    lora: tuple[str, ...]  # each --lora SRC[:SCALE] as given (the spec's CliForm parses them)
    dtype: str
    weights_dtype: Optional[str]
    weights_layers: str
    encoders_on: str
    variant: Optional[str]
    cache: Optional[str]
    config: Optional[str]
    controlnet: Optional[str]
    refiner: Optional[str]
    backend: str
    compile_mode: str

    def sized(self, size: Optional[tuple[int, int]], inputs: tuple[tuple[str, Any], ...] = ()) -> CallOptions:
        """A tiny random model's defaults (``ResolvedModel``) where the flags give none: its
        ``size`` (width, height) unless either is given, and its other ``inputs`` one by one."""
        flags, pair = dict(self.flags), size_flags()
        if size is not None and not pair.given(flags):
            flags.update({flag: [str(side)] for flag, side in pair.inputs(size).items()})
        for name, value in inputs:
            flags.setdefault("--" + name.replace("_", "-"), [str(value)])
        return replace(self, flags=flags)

    def common_inputs(self) -> dict[str, Any]:
        """The sampler's settings and the LoRAs, as ``generate`` keywords."""
        kwargs: dict[str, Any] = {}
        for spec in _cli_specs():
            value = getattr(self, spec.name)
            if spec is COUNT:
                continue
            if spec.cli_form is not None:  # repeated texts in its own syntax: absent when none is given
                if value:
                    kwargs[spec.name] = [spec.cli_form.parse(text) for text in value]
                continue
            kwargs[spec.name] = value
        return kwargs

    def call_inputs(self, pipe: Any) -> dict[str, Any]:
        """``pipe(n, **call_inputs(pipe))``: the family's inputs, typed by ``pipe``'s specs (a flag
        the model does not declare fails naming those it does), and the common ones."""
        from preheat.cli.family_options import family_values

        return {**self.common_inputs(), **family_values(pipe, self.flags)}

    def load_options(self) -> dict[str, Any]:
        """``preheat.load(model, **load_options())``."""
        options = dict(dtype=self.dtype, cache=self.cache, backend=self.backend, compile=self.compile_mode,
                       variant=self.variant, weights_dtype=self.weights_dtype, weights_layers=self.weights_layers,
                       encoders_on=self.encoders_on)
        from preheat.warm import companions

        given = {} if self.config is None else {"config": self.config}
        return {**options, **given, **companions(self)}

    def batch(self, pipe: Any) -> int:
        """``--n``, or the family's preview count (16 for a class model, 1 for text-to-image)."""
        return self.n if self.n is not None else pipe.family.preview_n


COUNT = common_spec("n")  # the image count: ``pipe(n, ...)``'s first argument (``CallOptions.batch``), no keyword


def _cli_specs() -> tuple[InputSpec, ...]:
    """The common inputs ``preheat sample`` takes (``"cli"`` in their surfaces), in their declared order."""
    return tuple(s for s in COMMON_SPECS if "cli" in s.surfaces)


def spec_option(spec: InputSpec, **overrides: Any) -> Callable[..., Any]:
    """A common input's option, from its declaration: its flag, its type's bounds (click refuses a
    value out of them in one line naming the flag, before anything loads), its default and its CLI
    text. A declared ``CliForm`` is a command-line syntax of its own (the LoRA's repeated
    ``SRC[:SCALE]``: the texts as given, parsed by the form); a Choice whose options the model
    resolves is the sampler (preheat's sampler names, listed when --help is shown).

    ``overrides`` are a command's own wording of the same input (``preheat bench``'s defaults,
    its help): ``default``, ``help``, ``multiple`` (one run per value: ``bench sampler``'s counts),
    ``param`` (the command's parameter, where not the keyword). The flag, the type and the bounds
    are always the spec's."""
    kind = spec.type
    text = overrides.get("help", spec.describe("cli"))
    default = overrides.get("default", spec.default)
    param = overrides.get("param", spec.name)
    if spec.cli_form is not None:  # each text as given
        return click.option(spec.cli_flag, param, multiple=True, metavar=spec.cli_form.metavar, help=text)
    if isinstance(kind, Choice) and not kind.options:
        return click.option(spec.cli_flag, param, cls=_SamplerHelp, type=SAMPLER, default=default, help=text)
    if isinstance(kind, Int):
        ptype: click.ParamType = click.IntRange(kind.low, kind.high)
    elif isinstance(kind, Float):
        ptype = click.FloatRange(kind.low, kind.high, min_open=kind.low_open)
    elif isinstance(kind, Choice):
        ptype = click.Choice(kind.options)
    else:
        ptype = click.STRING
    multiple = bool(overrides.get("multiple", False))
    return click.option(spec.cli_flag, param, type=ptype, default=default, multiple=multiple,
                        show_default=default is not None and not multiple, help=text)


def common_option(name: str, **overrides: Any) -> Callable[..., Any]:
    """The option of the common input ``name`` (:data:`COMMON_SPECS`) for a command other than
    ``preheat sample`` (``preheat bench``): the declared flag, type and bounds, with the
    command's own ``default`` / ``help`` where it has them (see :func:`spec_option`)."""
    return spec_option(common_spec(name), **overrides)


def size_options(help: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The image size's two options for a command other than ``preheat sample`` (``preheat
    bench``), from its declaration (``families.inputs.size_specs``: the flags, positive ints),
    absent by default (the model's own size); ``help`` goes before each one's declared text. The
    command receives them as one ``size``: (width, height), or None unless both are given."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, size=IMAGE_SIZE.of({key: kwargs.pop(key) for key in IMAGE_SIZE}), **kwargs)

        out: Callable[..., Any] = wrapper
        for spec in reversed(cli_size_specs()):
            text = f"{help} {spec.describe('cli')}".strip()
            out = spec_option(spec, default=None, help=text)(out)
        return out

    return decorate


def renamed_option(old: str, param: str, new: str, multiple: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``old``, a count flag renamed ``new``, still works (hidden, with a deprecation line): a
    repeatable one's values join those ``new`` gives ``param``; a single one (``multiple=False``)
    stands for ``new`` when that is not given (both: one line)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, old_values: Any, **kwargs: Any) -> Any:
            if old_values is not None and old_values != ():
                click.echo(f"warning: {old} is deprecated; use {new}", err=True)
                if multiple:
                    kwargs[param] = (*kwargs[param], *old_values)
                elif kwargs[param] is not None:
                    raise click.BadOptionUsage(old, f"{old} is the old spelling of {new}: give {new} only")
                else:
                    kwargs[param] = old_values
            return fn(*args, **kwargs)

        return click.option(old, "old_values", multiple=multiple, type=POSITIVE, hidden=True)(wrapper)

    return decorate


def call_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """MODEL and every option of one call; the command receives them as ``opts: CallOptions``.
    The command must be a ``cli.family_options.FamilyInputsCommand`` (``cls=``): what it does not
    declare (MODEL and the family's input flags) arrives in ``ctx.args``."""
    options = [
        *(spec_option(s) for s in _cli_specs()),
        model_options,
        click.option("--backend", type=click.Choice(["jax", "torch"]), default="jax", show_default=True),
        click.option("--compile", "compile_mode", type=click.Choice(["none", "inductor", "aot", "regional"]),
                     default="none", show_default=True,
                     help="torch backend: eager, torch.compile, AOTInductor, or regional (repeated blocks)."),
    ]
    names = [f.name for f in CallOptions.__dataclass_fields__.values() if f.name not in ("model", "flags")]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from preheat.cli.family_options import parse_flags

        model, flags = parse_flags(click.get_current_context().args)
        opts = CallOptions(model=model, flags=flags, **{name: kwargs.pop(name) for name in names})
        return fn(*args, opts=opts, **kwargs)

    out: Callable[..., Any] = wrapper
    for option in reversed(options):
        out = option(out)
    return out
