"""The `preheat` command: a thin layer over the library, and the only place that imports click.

Each subcommand checks its options, calls the library, and prints. A ``PreheatError`` prints as
one line on stderr (``error: ...``) and exits 2 for bad arguments, 1 for everything else; never a
traceback, never a partial output file.

    preheat.cli           the ``preheat`` group and its global options (``main``: the console script)
    preheat.cli.sample    ``preheat sample``
    preheat.cli.train     ``preheat train-digits``, ``preheat train-text-digits``
    preheat.cli.pull      ``preheat pull``
    preheat.cli.cache     ``preheat cache ls | info | verify | explain | prune | clear``
    preheat.cli.doctor    ``preheat doctor``
    preheat.cli.serve     ``preheat serve`` (also ``python -m preheat.server``)
    preheat.cli.warm      ``preheat warm`` (and the declaration options ``preheat serve`` shares)
    preheat.cli.bench     ``preheat bench sampler | coldstart | compare | serve``
    preheat.cli._support  one-line errors, shared by the commands
    preheat.cli.settings_env  the settings' options, generated from their declaration (``preheat.settings``);
                          ``serve`` and ``warm`` read absent ones from ``PREHEAT_<SETTING>``

Importing a command module is cheap: JAX, torch, FastAPI and the model code load when a command runs.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import click

from preheat._version import __version__

__all__ = ["main", "run"]

# Each command's module, imported when the command runs (or when --help lists them): `preheat
# sample` does not pay for the doctor's, the server's or the benches' imports.
COMMANDS: dict[str, tuple[str, str]] = {
    "sample": ("preheat.cli.sample", "sample"),
    "train-digits": ("preheat.cli.train", "train_digits_command"),
    "train-text-digits": ("preheat.cli.train", "train_text_digits_command"),
    "doctor": ("preheat.cli.doctor", "doctor_command"),
    "cache": ("preheat.cli.cache", "cache_group"),
    "pull": ("preheat.cli.pull", "pull_command"),
    "serve": ("preheat.cli.serve", "serve_command"),
    "warm": ("preheat.cli.warm", "warm_command"),
    "bench": ("preheat.cli.bench", "bench_group"),
}


class _OneLineUsageErrors(click.Group):
    """Click's usage errors (a bad or missing option value) as one line, like every other error:
    ``error: Invalid value for '--port': 99999 is not in the range 0<=x<=65535. (preheat serve --help)``.
    Subcommands come from ``COMMANDS``, each imported on first use (click's lazy-group pattern)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> Optional[click.Command]:
        if cmd_name not in COMMANDS:
            return None
        import importlib

        module, attr = COMMANDS[cmd_name]
        return getattr(importlib.import_module(module), attr)

    def main(self, args: Any = None, prog_name: Optional[str] = None, complete_var: Optional[str] = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        _exit_with_one_line_errors(lambda: super(_OneLineUsageErrors, self).main(
            args, prog_name, complete_var, standalone_mode=False, **extra))


def _exit_with_one_line_errors(invoke: Callable[[], Any]) -> None:
    """Run a click command's non-standalone ``main`` and exit with its status; click's errors are one
    line naming where to look (``(preheat serve --help)``), not its usage block. Serves the
    ``preheat`` group and a command run on its own (``python -m preheat.server``)."""
    import sys

    try:
        code = invoke()
    except click.UsageError as err:
        where = f" ({err.ctx.command_path} --help)" if err.ctx is not None else ""
        click.echo(f"error: {err.format_message()}{where}", err=True)
        sys.exit(err.exit_code)
    except click.ClickException as err:
        click.echo(f"error: {err.format_message()}", err=True)
        sys.exit(err.exit_code)
    except click.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_OneLineUsageErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="preheat")
@click.option("--cache-url", envvar="PREHEAT_CACHE_URL",
              help="Shared compile cache for a fleet: s3://bucket/prefix, any fsspec URL, or a shared folder.")
@click.option("--trust-remote-cache", is_flag=True, help="Use shared-cache entries without a signing key.")
def main(cache_url: str | None, trust_remote_cache: bool) -> None:
    """preheat: diffusion sampling that starts hot."""
    import logging
    import os

    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    if cache_url:
        os.environ["PREHEAT_CACHE_URL"] = cache_url
    if trust_remote_cache:
        os.environ["PREHEAT_TRUST_REMOTE_CACHE"] = "1"


def run(command: Optional[click.Command] = None, **options: Any) -> None:
    """The ``preheat`` console script, ``python -m preheat`` and ``python -m preheat.server``:
    ``command`` (default :func:`main`) called with ``options``, then the process ends after the
    atexit handlers without the interpreter's finalisation (:mod:`preheat.hard_exit` says why)."""
    from preheat.hard_exit import run_and_exit

    target = command or main
    run_and_exit(_exit_with_one_line_errors, invoke=lambda: target.main(standalone_mode=False, **options))
