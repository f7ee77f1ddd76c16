"""What every command shares: a ``PreheatError`` becomes one line on stderr and an exit code."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import click

from preheat.errors import InvalidArgumentError, PreheatError, SchedulerConfigError

__all__ = ["one_line_errors"]


def one_line_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn PreheatErrors into a one-line message and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PreheatError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(2 if isinstance(err, (InvalidArgumentError, SchedulerConfigError)) else 1)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)

    return wrapper
