"""What every command shares (kept apart from cli.py so that command modules can import it
without importing the CLI itself)."""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import click

from preheat.errors import InvalidArgumentError, PreheatError, SchedulerConfigError

__all__ = ["one_line_errors", "process_age_s"]

_IMPORTED_AT = time.perf_counter()


def process_age_s() -> float:
    """Seconds since this process started (the kernel's clock, so imports are counted)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED_AT


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
