"""`preheat doctor`: ``preheat.doctor.run_checks`` as a rich table, or one JSON object with ``--json``."""

from __future__ import annotations

import json

import click

from preheat.doctor.render import _render
from preheat.doctor.report import run_checks
from preheat.doctor.results import FAIL, OK, WARN

__all__ = ["doctor_command"]


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (checks, summary, versions) instead of a table.")
@click.option("--require-gpu", is_flag=True, help="Exit 1 unless JAX actually computes on a GPU.")
@click.pass_context
def doctor_command(ctx: click.Context, as_json: bool, require_gpu: bool) -> None:
    """Say what is wrong with this machine's GPU / JAX / torch / cache setup, and the exact fix.

    Exit status: 0 when no check fails, 1 when one does (or, with --require-gpu, when JAX is not
    computing on a GPU).
    """
    try:
        report = run_checks(require_gpu=require_gpu)
    except Exception as exc:  # run_checks should not raise; never show a traceback anyway
        msg = f"preheat doctor failed: {type(exc).__name__}: {exc}"
        if as_json:
            click.echo(json.dumps({"ok": False, "exit_code": 1, "error": msg, "checks": [], "summary": {OK: 0, WARN: 0, FAIL: 1}, "versions": {}}))
        else:
            click.echo(msg, err=True)
        ctx.exit(1)
        return
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        _render(report)
    ctx.exit(report.exit_code)
