"""The human output of `preheat doctor`: a rich table, the fixes one per line, a versions footer."""

from __future__ import annotations

import os
import sys

from preheat.doctor.results import FAIL, OK, WARN, Report

_STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red"}


def _render(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 140
    console = Console(highlight=False, width=width, soft_wrap=False)
    table = Table(title="preheat doctor", show_lines=False, expand=False)
    table.add_column("Check", no_wrap=True)
    table.add_column("Status", no_wrap=True)
    table.add_column("Finding", overflow="fold")
    for c in report.checks:
        table.add_row(Text(c.title), Text(c.status.upper(), style=_STYLE[c.status]), Text(c.finding))
    console.print(table)
    for c in report.checks:  # doctor --model: what goes where (models.footprint.Footprint.plan)
        if c.details and c.details.get("plan"):
            console.print(Text(f"Memory plan of {c.details.get('model')}:", style="bold"))
            for line in c.details["plan"]:
                console.print(Text(f"  {line}"), soft_wrap=True)
    todo = [c for c in report.checks if c.status != OK and c.fix]
    if todo:
        console.print(Text("How to fix:", style="bold"))
        for c in todo:
            line = Text(f"  [{c.status}] {c.title}: ", style=_STYLE[c.status])
            line.append(Text(c.fix or "", style="default"))
            console.print(line, soft_wrap=True)
    s = report.summary
    v = report.versions
    console.print(
        Text(
            f"{s[OK]} ok, {s[WARN]} warn, {s[FAIL]} fail in {report.elapsed_s:.1f} s; exit {report.exit_code}"
            + (" (--require-gpu)" if report.require_gpu else "")
        ),
        soft_wrap=True,
    )
    plugins = ", ".join(f"{k} {val}" for k, val in (v.get("jax_plugins") or {}).items())
    console.print(
        Text(
            f"python {v.get('python')} | preheat {v.get('preheat')} | jax {v.get('jax')} | jaxlib {v.get('jaxlib')}"
            + (f" | {plugins}" if plugins else "")
            + f" | torch {v.get('torch')}"
            + (f" | driver {v['nvidia_driver']} (CUDA {v.get('cuda_driver_supports') or '?'})" if v.get("nvidia_driver")
               else f" | TPU {(v.get('tpu') or {}).get('generation') or 'VM'}, libtpu {v.get('libtpu') or 'not installed'}" if v.get("tpu")
               else " | no NVIDIA driver"),
            style="dim",
        ),
        soft_wrap=True,
    )
