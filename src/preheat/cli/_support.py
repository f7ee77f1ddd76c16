"""What every command shares: a ``PreheatError`` becomes one line on stderr and an exit code."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, NamedTuple, Optional

import click

from preheat.errors import InvalidArgumentError, MissingExtraError, NamesInputs, PreheatError, SchedulerConfigError

__all__ = ["one_line_errors", "resolve_model", "ResolvedModel"]


def _in_flags(err: PreheatError) -> str:
    """The message, led by the flag that sets the argument it names (``--class``, not the
    engine's ``class_labels``), unless the message already names that flag."""
    from preheat.cli.options import FLAGS

    flag = FLAGS.get(getattr(err, "argument", None) or "")
    text = err.renamed(FLAGS) if isinstance(err, NamesInputs) else str(err)  # the inputs it names: flags
    return f"{flag}: {text}" if flag is not None and flag not in text else text


def one_line_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn PreheatErrors into a one-line message and an exit code; a module an optional extra
    provides, missing, into the line naming its ``pip install``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PreheatError as err:
            click.echo(f"error: {_in_flags(err)}", err=True)
            sys.exit(2 if isinstance(err, (InvalidArgumentError, SchedulerConfigError)) else 1)
        except ModuleNotFoundError as err:
            ctx = click.get_current_context(silent=True)
            missing = MissingExtraError.of(err, ctx.command_path if ctx is not None else "preheat")
            if missing is None:
                raise
            click.echo(f"error: {missing}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)

    return wrapper


class ResolvedModel(NamedTuple):
    """A MODEL argument as the library takes it, and what a tiny random model defaults to."""

    model: Optional[str]  # a folder, a store source, builtin:/random:NAME, or None (the built-in model)
    size: Optional[tuple[int, int]]  # (width, height) to use where none is given; None: the model's own
    inputs: tuple[tuple[str, Any], ...] = ()  # other inputs' defaults at its tiny scale (keyword, value)


def resolve_model(model: Optional[str]) -> ResolvedModel:
    """MODEL unchanged (``preheat.load`` resolves every form, ``random:NAME`` included) with a tiny
    random model's size and input defaults (``preheat.model_source.random_defaults``)."""
    from preheat.model_source import random_defaults

    size, inputs = random_defaults(model)
    return ResolvedModel(model, size, inputs)
