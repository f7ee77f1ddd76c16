"""The `preheat` command: a thin layer over the library.

Each subcommand lives beside the code it fronts and is registered here. Errors that are
``PreheatError`` print as one line on stderr and exit 2 (usage) or 1 (runtime); never a traceback.
"""

from __future__ import annotations

import click

from preheat._version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="preheat")
def main() -> None:
    """preheat: diffusion sampling that starts hot."""


def _register() -> None:
    from preheat.doctor import doctor_command

    main.add_command(doctor_command, "doctor")


_register()
