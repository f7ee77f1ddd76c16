"""`preheat warm`: compile a declared set of programs ahead of time (a Docker build step, CI, or
a one-off job against the fleet store), so that a new pod's first request never compiles.

The declaration's options (``declaration_options``, generated from ``preheat.settings``:
the fields of surface ``warm``) are the same on ``preheat serve``, so a warm
job and a server agree on what "warm" means; both read an absent option's ``PREHEAT_<SETTING>``
variable (``cli.settings_env``), so a warm job in the server's environment agrees with it too.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

import click

from preheat.cli._support import one_line_errors
from preheat.cli.options import NON_NEGATIVE
from preheat.cli.settings_env import (SettingsCommand, flag_of, names_of, setting_option, settings_given,
                                     settings_options)
from preheat.settings import samplers_from_text

__all__ = ["warm_command", "declaration_options", "inputs_option", "input_values_option", "samplers_from_text"]

# the optional inputs a declaration offers and the served values of static inputs besides the size:
# `warm`, `serve`, and `cache explain` (whose call must use only these; with --as-server, takes them
# as such a server would)
inputs_option = setting_option("inputs", "inputs_text")
input_values_option = setting_option("input_values", "input_values_text")

#: MODEL, --dtype, --variant, --cache, --max-batch-size, --samplers, --sizes, --guidance, --inputs,
#: --input-values, --lora-ranks, --devices, --progress, --fsdp: the warm set (``ServeSettings.warm_set``)
declaration_options = settings_options("warm")


@click.command("warm", cls=SettingsCommand)
@declaration_options
@click.option("--dry-run", is_flag=True, help="List the signatures and where each is cached; compile nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--push-timeout-s", default=600.0, show_default=True, type=NON_NEGATIVE,
              help="How long uploads to PREHEAT_CACHE_URL may take after the last compile.")
@click.option("--target", "target_spec", metavar="NAME|FILE",
              help="Compile for this GPU or TPU instead of this machine's devices (no accelerator needed): h200, "
                   "h100-sxm, h100-pcie, a100-80, a100-40, b200, or a description file from `preheat doctor "
                   "--save-target` (l40s, rtx4090 and other GPUs XLA does not describe), with the cuda13 extra's "
                   "plugin; v5e, v5e:2x2, v5e:2x4, v6e, v6e:2x2, v5p, v4 with the tpu extra's libtpu.")
@click.option("--quiet", is_flag=True, help="No progress bar (it is drawn only when stderr is a terminal).")
@one_line_errors
def warm_command(dry_run: bool, as_json: bool, push_timeout_s: float, target_spec: Optional[str], quiet: bool,
                 **declared: Any) -> None:
    """Compile MODEL's serving programs into the cache root ahead of time (and push them to
    PREHEAT_CACHE_URL when set), so `preheat serve` with the same options starts with no compile.
    MODEL: a diffusers folder, store source or random:NAME ($PREHEAT_MODEL); nothing for the
    built-in model. Each declaration option not given is read from its PREHEAT_<SETTING> variable, as `preheat
    serve` (and Runpod and Ray) read it, so a warm job in the server's environment warms what it serves."""
    import sys

    import preheat
    from preheat import warm as warming

    from preheat.warm import SettingNames

    name_of = names_of()
    settings = settings_given(declared)  # the declaration's options, as ServeSettings
    warm_set = settings.warm_set(name_of)
    names = SettingNames.by(name_of)  # set-up messages name the flag or the variable, as given
    target = None
    if target_spec is not None:
        target, warm_set = _target_compiles(target_spec, warm_set, settings.progress, name_of)
    # what is cached already loads while the weights are read (a dry run, or a --target one, loads nothing)
    pipe = preheat.load(warm_set.model, **warming.load_keywords(warm_set),
                        prefetch=None if dry_run or target else warming.prefetch_calls(warm_set))
    if target is not None:
        from preheat.cache.compile import TargetCompiler

        pipe.compiler = TargetCompiler(target)
    if dry_run:
        resolved = warming.resolve(pipe, warm_set, names)
        remote = pipe.compiler.remote if pipe.compiler is not None else None
        rows = []
        def where(found: dict[str, Any]) -> dict[str, Any]:
            return {"local": "cached" if found["local"] else "missing",
                    "remote": None if remote is None else {True: "cached", False: "missing", None: "unknown"}[found["remote"]]}

        for sig in warming.signatures(pipe, resolved):
            stages = warming.programs(pipe, sig, remote)  # encoders, denoise, decode: every program of the call
            denoise = next(p for p in stages if p["stage"] == "denoise")
            rows.append({"signature": sig.describe(), "key": denoise["key"], **where(denoise),
                         "programs": [{"stage": p["stage"], "key": p["key"], **where(p)} if "skipped" not in p
                                      else p for p in stages]})
        offered = warming.offered_inputs(pipe, resolved)  # required and optional: what a server takes
        if as_json:
            click.echo(json.dumps({"inputs": offered._asdict(), "signatures": rows}, indent=1))
            return
        declared = offered.optional or offered.not_offered
        others = f"not offered: {', '.join(offered.not_offered) or 'none'}" if declared else "no optional inputs"
        click.echo(f"inputs offered: {', '.join(offered.required + offered.optional) or 'none'} ({others})")

        def line(row: dict[str, Any]) -> str:
            return f"local {row['local']}" + (f", remote {row['remote']}" if row["remote"] is not None else "")

        for row in rows:
            click.echo(f"{row['signature']}  key {row['key'][:12]}  {line(row)}")
            for prog in row["programs"]:
                if "skipped" in prog:  # warm --target: a host stage, compiled on the machine that runs it
                    click.echo(f"    + {prog['stage']} program not compiled here: it {prog['skipped']}")
                elif prog["stage"] != "denoise":  # the other programs the call runs (text families)
                    click.echo(f"    + {prog['stage']} program {prog['key'][:12]}  {line(prog)}")
        missing = sum(row["local"] == "missing" for row in rows)
        others = sum(p["local"] == "missing" for row in rows for p in row["programs"] if p["stage"] != "denoise")
        click.echo(f"{len(rows)} signature(s), {missing} missing locally"
                   + (f"; {others} encoder/decoder program(s) missing locally" if others else ""))
        return
    from preheat.terminal import Count, shown

    with Count(shown(quiet), "warm: signatures") as bar:  # signatures done of total, above their log lines
        result = warming.warm(warm_set, pipe=pipe, log=bar.print, push_timeout_s=push_timeout_s,
                              done=lambda k, total: bar.update(k, total), names=names)
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        layers: dict[str, int] = {}
        for row in result["signatures"]:
            layers[row["cache_layer"]] = layers.get(row["cache_layer"], 0) + 1
        click.echo(f"warm: {len(result['signatures'])} signature(s) ready ({', '.join(f'{v} {k}' for k, v in sorted(layers.items()))})"
                   + ("" if result["pushed"] else "; the store (PREHEAT_CACHE_URL) lacks some: see the warnings"))
    unrunnable = [row["signature"] for row in result["signatures"] if row.get("unrunnable")]
    if unrunnable:
        click.echo(f"warning: {len(unrunnable)} of {len(result['signatures'])} signature(s) make cuDNN calls that a "
                   "compile without the GPU cannot finish (a convolution's algorithm, a fused attention's graph); "
                   "a GPU will not run those executables, so pods skip them and compile their own (docs/gpu.md)",
                   err=True)
    if not result["pushed"]:
        sys.exit(1)


def _target_compiles(spec: str, warm_set: Any, progress: Optional[bool],
                     name_of: Callable[[str], str] = flag_of) -> tuple[Any, Any]:
    """The target of ``--target`` (one line for an unknown name, a malformed file or no plugin,
    before any weights are read) and the set, on one device (a target's programs are single-device
    ones) and without step progress (its host callback needs the device's runtime to be lowered)."""
    from dataclasses import replace

    from preheat.cache.targets import resolve_target, target_device
    from preheat.errors import InvalidArgumentError

    target = resolve_target(spec)
    target_device(target)
    if warm_set.devices not in (None, 1, [0], (0,)) or warm_set.fsdp != 1:
        raise InvalidArgumentError(f"--target compiles single-device programs; leave {name_of('devices')} and "
                                   f"{name_of('fsdp')} unset", argument="devices")
    if progress:
        raise InvalidArgumentError(f"{name_of('progress')} cannot be compiled for a --target (the step callback needs the "
                                   "device's runtime); warm with --no-progress and serve with --no-progress",
                                   argument="--progress")
    return target, replace(warm_set, devices=1, progress=False)

