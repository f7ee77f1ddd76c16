"""A family's declared inputs as command-line options, with no hand-written option per input.

``preheat sample`` (and any command sharing its option set, like ``cache explain``) uses
:class:`FamilyInputsCommand`: every flag it does not declare itself is a family input
(``InputSpec.cli_flag``: ``--prompt``, ``--negative-prompt``, ``--class``, ``--width``,
``--original-size 1024,1024``, ...), repeated for one value per image. The flags are read as
text when the command line is parsed and typed by the loaded model's own specs
(``Family.input_specs``), so parsing imports no family; ``--help`` lists every declared
family's inputs (importing them, which only help pays).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import click

from preheat.errors import InvalidArgumentError, SchedulerConfigError
from preheat.families.inputs import COMMON_SPECS, SizePair

__all__ = ["FamilyInputsCommand", "parse_flags", "family_values", "flag_errors", "FLAGS", "size_flags",
           "cli_size_specs"]

# The engine's common keyword -> the CLI flag that sets it: errors on the CLI name the flag. Every
# common input with a declared flag, the CLI's or not (a LoRA's scale is given inside --lora
# SRC[:SCALE]); a family's own inputs are named by their declared specs
# (:func:`flag_errors`).
FLAGS = {**{s.name: s.cli_flag for s in COMMON_SPECS if "cli" in s.surfaces or s.flag is not None},
         "weights_dtype": "--weights-dtype", "weights_layers": "--weights-layers", "encoders_on": "--encoders-on",
         "controlnet": "--controlnet",
         "refiner": "--refiner"}


class FamilyInputsCommand(click.Command):
    """A click command whose unknown ``--flag VALUE`` pairs are family inputs (``ctx.args``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = dict(kwargs.pop("context_settings", None) or {})
        settings.update(ignore_unknown_options=True, allow_extra_args=True)
        super().__init__(*args, context_settings=settings, **kwargs)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_options(ctx, formatter)
        from preheat.families import declared_families

        rows: dict[str, tuple[str, list[str]]] = {}
        for family in declared_families():
            for spec in (s for s in (*family.specs, *cli_size_specs()) if "cli" in s.surfaces):
                flag = spec.cli_flag
                help_text, names = rows.get(flag, (spec.describe("cli"), []))
                names.append(family.name)
                rows[flag] = (help_text, names)
        with formatter.section("Model inputs (each family's declared inputs; repeat a flag for one per image)"):
            formatter.write_dl([(flag, f"{text} [{', '.join(dict.fromkeys(names))}]")
                                for flag, (text, names) in rows.items()])


def cli_size_specs() -> tuple[Any, ...]:
    """The size's two specs with nothing of a model resolved (native 0: "the model's native size"),
    for the flags, the help and a bench's options (any positive size; the model checks its own)."""
    from preheat.families.inputs import size_specs

    return size_specs(0, 0, 1, None)


def size_flags() -> SizePair:
    """The image size as the CLI keys it: its two declared flags (``--width``, ``--height``)."""
    return SizePair(*(s.cli_flag for s in cli_size_specs()))


def parse_flags(args: Sequence[str]) -> tuple[str | None, dict[str, list[str]]]:
    """The command's MODEL and its family flags, from what click left over:
    ``["m", "--prompt", "a fox", "--class=3", "--class", "4"]`` -> ("m", {"--prompt": ["a fox"],
    "--class": ["3", "4"]}). A flag always takes a value, so the one bare word is MODEL."""
    out: dict[str, list[str]] = {}
    model: str | None = None
    items = list(args)
    i = 0
    while i < len(items):
        token = items[i]
        if not token.startswith("--") or token == "--":
            if model is not None:
                raise InvalidArgumentError(f"unexpected argument {token!r} (MODEL is {model!r})", argument=token)
            model = token
            i += 1
            continue
        flag, eq, value = token.partition("=")
        if not eq:
            if i + 1 >= len(items):
                raise InvalidArgumentError(f"{flag} needs a value", argument=flag)
            value = items[i + 1]
            i += 1
        out.setdefault(flag, []).append(value)
        i += 1
    return model, out


def family_values(pipe: Any, flags: dict[str, list[str]]) -> dict[str, Any]:
    """The flags as ``generate`` keywords, typed by the model's specs (one value for all images,
    or a list: one per image). A flag the model does not declare fails naming those it does."""
    from preheat.families.inputs import typed_flags

    specs = pipe.family.input_specs(pipe)
    _refuse_companion_flags(specs, flags)
    return typed_flags(specs, pipe.family.name, flags)


def _refuse_companion_flags(specs: Any, flags: dict[str, list[str]]) -> None:
    """A flag that only a second model folder declares (--control-image: a ControlNet's;
    --denoising-end: a refiner's), given without it: one line naming the option that loads it."""
    from preheat.families.control import CONTROL_NAMES
    from preheat.families.experts import REFINER_NAMES

    declared = {s.name for s in specs}
    for option, names, what in (("--controlnet", CONTROL_NAMES, "a ControlNet"),
                                ("--refiner", REFINER_NAMES, "a refiner")):
        for flag in flags:
            name = flag.lstrip("-").replace("-", "_")
            if name in names and name not in declared:
                raise InvalidArgumentError(f"{flag} needs {what}: load the model with {option} FOLDER", argument=flag)


@contextlib.contextmanager
def flag_errors(pipe: Any) -> Iterator[None]:
    """An engine error about a family input names the flag that set it (``--class: unknown class 12``),
    and every input its message names by its flag (``--timesteps has 2 entries but --steps=3``)."""
    try:
        yield
    except (InvalidArgumentError, SchedulerConfigError) as err:
        flags = {s.name: s.cli_flag for s in pipe.family.input_specs(pipe)}
        if err.argument not in flags:
            raise
        flag, text = flags[err.argument], err.renamed({**FLAGS, **flags})
        kind = SchedulerConfigError if isinstance(err, SchedulerConfigError) else InvalidArgumentError
        raise kind(text if text.startswith(flag) else f"{flag}: {text}", argument=flag) from None
