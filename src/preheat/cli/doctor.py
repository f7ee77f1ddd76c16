"""`preheat doctor`: ``preheat.doctor.run_checks`` as a rich table, or one JSON object with ``--json``."""

from __future__ import annotations

import json

import click

from preheat.cli._support import one_line_errors

from preheat.doctor.checks.model_fit import DTYPES, WEIGHTS_DTYPES
from preheat.doctor.context import ModelRequest
from preheat.doctor.render import _render
from preheat.doctor.report import run_checks
from preheat.doctor.results import FAIL, OK, WARN
from preheat.load_options import ENCODERS_ON

__all__ = ["doctor_command"]


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (checks, summary, versions) instead of a table.")
@click.option("--require-gpu", is_flag=True, help="Exit 1 unless JAX actually computes on a GPU.")
@click.option("--save-target", "save_target_path", metavar="FILE", type=click.Path(dir_okay=False),
              help="Write this GPU's description (XLA's target config) to FILE, for `preheat warm --target FILE` "
                   "on a machine without this GPU; run no checks.")
@click.option("--model", metavar="MODEL", help="Also check that MODEL's weights (a folder, or a pulled source) fit one "
                                               "device at --dtype, from their safetensors headers (nothing is read).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(DTYPES), help="With --model: the dtype it loads in.")
@click.option("--weights-dtype", type=click.Choice(WEIGHTS_DTYPES),
              help="With --model: 8-bit denoiser weights (int8 with per-channel scales, or fp8).")
@click.option("--weights-layers", type=click.Choice(["layerwise", "linear"]), default="layerwise", show_default=True,
              help="With --weights-dtype: diffusers' layerwise-casting layers, or every Linear (AdaLN modulation too).")
@click.option("--variant", help="With --model: weight files *.VARIANT.safetensors (e.g. fp16).")
@click.option("--offload-encoders", is_flag=True, help="With --model: text encoders kept in host memory (preheat.load's offload_encoders).")
@click.option("--encoders-on", type=click.Choice(ENCODERS_ON), default="device", show_default=True,
              help="With --model: the text encoders on the device, streamed in from host memory (offload), or "
                   "kept and run on the host's CPU (FLUX.1).")
@click.pass_context
def doctor_command(ctx: click.Context, as_json: bool, require_gpu: bool, save_target_path: str | None,
                   model: str | None, dtype: str, weights_dtype: str | None, weights_layers: str,
                   variant: str | None, offload_encoders: bool, encoders_on: str) -> None:
    """Say what is wrong with this machine's GPU or TPU / JAX / torch / cache setup, and the exact fix.

    Exit status: 0 when no check fails, 1 when one does (or, with --require-gpu, when JAX is not
    computing on a GPU).
    """
    if save_target_path is not None:
        _save_target(save_target_path)
        return
    request = ModelRequest(model, dtype, weights_dtype, variant, offload_encoders, weights_layers,
                           encoders_on) if model else None
    try:
        report = run_checks(require_gpu=require_gpu, model=request)
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


@one_line_errors
def _save_target(path: str) -> None:
    """``--save-target FILE``: this machine's first GPU, described for ``warm --target FILE``."""
    from pathlib import Path

    from preheat.cache.targets import save_target

    target = save_target(Path(path))
    cc = ".".join(map(str, target.gpu["compute_capability"]))
    click.echo(f"wrote {path}: {target.device_name or 'this GPU'}, compute capability {cc}, "
               f"{target.gpu['core_count']} cores; use it as `preheat warm MODEL --target {path}`")

