"""`preheat cache ls | info | verify | explain | prune | clear`: a thin CLI over preheat.cache."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from preheat.cli._support import one_line_errors
from preheat.cli.family_options import FamilyInputsCommand, flag_errors, size_flags
from preheat.cli.options import NON_NEGATIVE, POSITIVE, CallOptions, call_options
from preheat.cli.settings_env import SettingsCommand
from preheat.cli.warm import input_values_option, inputs_option, samplers_from_text
from preheat.families.inputs import IMAGE_SIZE, common_spec, size_pair
from preheat.server.config import env_var

STEPS = common_spec("steps")  # the step count: torch explain runs the call at its fewest steps


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _age(t: float) -> str:
    if not t:
        return "-"
    s = time.time() - t
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"


def _summary(fields: dict) -> str:
    sig = fields.get("signature", {})
    spec = sig.get("spec", {}) if isinstance(sig, dict) else {}
    model = fields.get("model", {})
    name = model.get("name") or model.get("kind", "?")
    shape = "x".join(str(s) for s in sig.get("sample_shape", [])) if isinstance(sig, dict) else ""
    from preheat.platforms import key_device_label

    device = key_device_label(fields)
    return (f"{name} {spec.get('solver', sig.get('mode', '?'))} b={sig.get('batch', '?')} {shape} {sig.get('dtype', '')} "
            f"{fields.get('platform', '')}/{device} jax {fields.get('jax', fields.get('torch', ''))}")


@click.group("cache")
def cache_group() -> None:
    """Inspect and maintain the cache root (compiled programs and weights)."""


@cache_group.command("ls")
@one_line_errors
def ls_command() -> None:
    """One row per entry: kind, key, size, age, last use, hits, and its key fields."""
    from rich.console import Console
    from rich.table import Table

    from preheat.cache.manage import list_entries
    from preheat.cache.root import resolve_root

    root = resolve_root()
    table = Table(title=f"preheat cache: {root}")
    for col in ("kind", "key", "size", "age", "used", "hits", "target", "program"):
        table.add_column(col)
    for e in list_entries(root.path):
        table.add_row(e.kind, e.key[:12], _human(e.size), _age(e.created), _age(e.last_used), str(e.hits), e.target,
                      _summary(e.fields))
    console = Console()
    console.print(table)
    from preheat.store import derived_folders

    derived = derived_folders(root.path)  # converted single files and their config folders
    if derived:
        made = Table(title="folders made from model files (models/single*): what `cache prune` does")
        for col in ("folder", "state", "prune", "why"):
            made.add_column(col)
        for d in derived:
            made.add_row(d.name, d.state, "collects" if d.collect else "keeps", _why(d, d.collect))
        console.print(made)


def _why(d: Any, collected: bool) -> str:
    """Why prune collects or keeps a folder made from model files (``preheat.store.Derived``)."""
    if d.state == "missing-source":
        return d.why + ("; --drop-missing-sources" if collected else "; kept until `preheat cache prune "
                                                                      "--drop-missing-sources`")
    return d.why


@cache_group.command("info")
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def info_command(as_json: bool) -> None:
    """Where the root is and why, and what it holds."""
    from preheat.cache.manage import disk_usage, list_entries, max_bytes
    from preheat.cache.root import resolve_root

    root = resolve_root()
    entries = list_entries(root.path)
    seen: set[tuple[int, int]] = set()  # hard-linked files (the store's snapshots and blobs) count once

    def du(p: Path) -> int:
        return disk_usage(p, seen)

    info = {
        "root": str(root.path), "reason": root.reason,
        "entries": {k: sum(1 for e in entries if e.kind == k) for k in ("jax", "torch")},
        "compile_bytes": sum(e.size for e in entries), "xla_bytes": du(root.path / "compile" / "xla"),
        "models_bytes": du(root.path / "models"), "random_bytes": du(root.path / "random"),
        "quarantined": len(list((root.path / "quarantine").glob("*"))) if (root.path / "quarantine").is_dir() else 0,
        "max_bytes": max_bytes(),
    }
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"root: {info['root']} ({info['reason']})")
    click.echo(f"entries: {info['entries']['jax']} jax, {info['entries']['torch']} torch, {_human(info['compile_bytes'])} "
               f"(cap {_human(info['max_bytes'])}); xla cache {_human(info['xla_bytes'])}; models {_human(info['models_bytes'])}"
               + (f"; random:NAME folders {_human(info['random_bytes'])}" if info["random_bytes"] else "")
               + f"; quarantined {info['quarantined']}")


@cache_group.command("verify")
@click.option("--quarantine", "quarantine_bad", is_flag=True, help="Move bad entries aside.")
@one_line_errors
def verify_command(quarantine_bad: bool) -> None:
    """Check every entry's manifest and sha256; exit 1 if any fails."""
    from preheat.cache.manage import verify_entries
    from preheat.cache.root import resolve_root

    from preheat.store import verify_store

    root = resolve_root().path
    infos = verify_entries(root, quarantine_bad=quarantine_bad)
    bad = [i for i in infos if not i.ok]
    for i in bad:
        click.echo(f"BAD  {i.kind}/{i.key[:12]}: {i.problem}")
    store_problems = verify_store(root)
    for p in store_problems:
        click.echo(f"BAD  models/{p}")
    click.echo(f"{len(infos) - len(bad)} ok, {len(bad)} bad compile entries; {len(store_problems)} weights-store problems")
    sys.exit(1 if bad or store_problems else 0)


class ExplainCommand(SettingsCommand, FamilyInputsCommand):
    """`cache explain`: with ``--as-server``, the server's declaration that the command line does not
    give is read from its ``PREHEAT_*`` variables, as `preheat serve` reads them, so that explain run
    in a pod's environment explains that pod's calls. Only the declaration: the call's own options
    are sample's (``PREHEAT_GUIDANCE`` is a server's guidance modes, ``--guidance`` a call's scale)."""

    env_settings = ("dtype", "variant", "cache", "weights_dtype", "weights_layers", "encoders_on", "config", "controlnet",
                    "refiner",
                    "devices", "fsdp",
                    "max_batch_size", "progress", "inputs", "input_values", "sizes", "samplers")
    env_gate = "--as-server"


@cache_group.command("explain", cls=ExplainCommand, options_metavar="[MODEL] [OPTIONS]")
@call_options
@click.option("--devices", "devices_text", metavar="all|N|ID,ID,...", help="The devices the call is split over.")
@click.option("--fsdp", default=1, show_default=True, type=POSITIVE, metavar="F",
              help="The devices each weight is split over.")
@click.option("--target", "target_spec", metavar="NAME|FILE",
              help="JAX: explain the key of this GPU's or TPU's program (`preheat warm --target`), not this machine's.")
@click.option("--as-server", is_flag=True,
              help="JAX: the call as `preheat serve` (and `preheat warm`) with --max-batch-size and --progress makes "
                   "it: --n images padded to the server's batch bucket, with its step reports. The server's "
                   "settings not given here (MODEL, --dtype, --max-batch-size, --progress, --devices, ...) are "
                   "read from $PREHEAT_MODEL, $PREHEAT_DTYPE, ... as serve reads them. Without it: as `preheat "
                   "sample` calls.")
@click.option("--max-batch-size", type=POSITIVE, metavar="B",
              help="--as-server: the server's --max-batch-size (default 8, as serve's), which sets its buckets.")
@click.option("--progress/--no-progress", "progress", default=None,
              help="--as-server: the server's --progress (default on, as serve's).")
@click.option("--samplers", "samplers_text", metavar="A,B,...",
              help="--as-server: the server's --samplers (default the model's own); a call without --sampler gets the "
                   "model's own where served, else the first; one not served is refused, as the server refuses it.")
@click.option("--sizes", "sizes_text", metavar="WxH,...",
              help="--as-server: the server's --sizes (default the model's), the first what a call without a size "
                   "gets; a size it does not serve is refused, as the server refuses it.")
@inputs_option
@input_values_option
@one_line_errors
def explain_command(opts: CallOptions, devices_text: str | None, fsdp: int, target_spec: str | None,
                    as_server: bool, max_batch_size: int | None, progress: bool | None,
                    inputs_text: str | None, input_values_text: str | None, sizes_text: str | None,
                    samplers_text: str | None) -> None:
    """Would `preheat sample` with these options hit the cache? If not, which key fields differ from
    the nearest entry. Takes exactly sample's options, with its defaults; with --as-server, the same
    request as a server (or warm job) declared by --max-batch-size and --progress runs it. With
    --inputs (as warm's and serve's), only a call of the programs such a declaration has: one that
    gives an input it does not offer is refused. --backend torch (with --compile regional, inductor
    or aot) runs the call once eagerly, one step, and says for every compiled piece whether an entry
    would serve it."""
    import preheat
    from preheat.cache.entry_cache import nearest_entry
    from preheat.cache.keys import key_fields, key_of
    from preheat.cache.manage import target_label
    from preheat.cli._support import resolve_model
    from preheat.errors import InvalidArgumentError
    from preheat.sharding import parse_devices

    if not as_server and (max_batch_size is not None or progress is not None or input_values_text is not None
                          or sizes_text is not None or samplers_text is not None):
        raise InvalidArgumentError("--max-batch-size, --progress, --samplers, --sizes and --input-values describe a "
                                   "server's call: pass --as-server", argument="--as-server")
    if as_server and opts.model is None and os.environ.get(env_var("model"), "").strip():
        opts = dataclasses.replace(opts, model=os.environ[env_var("model")].strip())  # as serve's MODEL
    resolved = resolve_model(opts.model)
    size_asked = size_flags().given(opts.flags)  # else a server's first size (sample's: the model's own)
    model, opts = resolved.model, opts.sized(resolved.size, resolved.inputs)  # as sample: a tiny random model's tiny size
    if opts.backend == "torch":
        if opts.compile_mode == "none":
            raise InvalidArgumentError("--backend torch --compile none compiles nothing to explain; pass --compile "
                                       "regional, inductor or aot", argument="--compile")
        if devices_text is not None or fsdp != 1 or target_spec is not None or as_server:
            raise InvalidArgumentError("--devices, --fsdp, --target and --as-server apply to --backend jax",
                                       argument="--devices")
        _explain_torch(model, opts, inputs_text)
        return
    if opts.compile_mode != "none":
        raise InvalidArgumentError(f"--compile {opts.compile_mode} applies to --backend torch", argument="--compile")
    target = None
    if target_spec is not None:
        from preheat.cache.targets import resolve_target, target_device

        target = resolve_target(target_spec)
        target_device(target)  # no plugin or libtpu: one line, before the model is read
    load = {k: v for k, v in opts.load_options().items() if k not in ("backend", "compile")}
    pipe = preheat.load(model, devices=parse_devices(devices_text, "--devices"), fsdp=fsdp, **load)
    _check_offered(pipe, model, inputs_text, opts)
    n, served = opts.batch(pipe), {}
    with flag_errors(pipe):
        given = opts.call_inputs(pipe)
    if as_server:  # the server's declaration (serve's defaults where not given): its bucket and step reports
        from preheat.warm import SettingNames, WarmSet, parse_input_values, parse_sizes, resolve, served_call
        from preheat.cli.settings_env import names_of

        names = SettingNames.by(names_of())  # each flag, or its PREHEAT_* where it came from there
        sizes = parse_sizes(sizes_text, names.sizes) or ((resolved.size,) if resolved.size is not None else ())
        server = resolve(pipe, WarmSet(model=model, dtype=opts.dtype, progress=WarmSet.progress if progress is None
                                       else progress, max_batch_size=max_batch_size or WarmSet.max_batch_size,
                                       sizes=sizes, samplers=samplers_from_text(samplers_text, names.samplers),
                                       input_values=parse_input_values(input_values_text, names.input_values)), names)
        call = served_call(pipe, server, n)
        click.echo(f"as a server with --max-batch-size {server.max_batch_size} calls it: {n} image(s) as batch "
                   f"{call.bucket}, step reports {'on' if call.inputs else 'off'}")
        n, served = call
        given = _as_served(pipe, server, given if size_asked else IMAGE_SIZE.without(given), names)
    with flag_errors(pipe):
        sig, args = pipe.prepare(n, **given, **served)
    fields = key_fields(pipe.fingerprint, sig, args, target=target)
    key = key_of(fields)
    kind_dir = pipe.compiler.root / "compile" / "jax" if pipe.compiler else None

    def labelled(name: str) -> str:  # an entry and its target ("local", or the GPU of a `warm --target` entry)
        try:
            manifest = json.loads((kind_dir / name / "manifest.json").read_text())
        except (OSError, ValueError):
            manifest = {}
        return f"{name[:12]} (target {target_label(manifest)})"

    if kind_dir is not None and (kind_dir / key / "manifest.json").is_file():
        click.echo(f"hit: entry {labelled(key)} exists for this call")
        return
    name, diff = nearest_entry(kind_dir, fields) if kind_dir is not None else (None, [])
    if name is None:
        click.echo(f"miss: key {key[:12]}; the cache has no entries to compare with")
    else:
        click.echo(f"miss: key {key[:12]}; nearest entry {labelled(name)} differs in: {', '.join(diff)}")


def _as_served(pipe: Any, server: Any, given: dict[str, Any], names: Any) -> dict[str, Any]:
    """The call's inputs as a server of ``server`` (a resolved ``WarmSet``) takes them, by the
    server's own rules (``families.offer``): its sampler (``--samplers``) and size (``--sizes``) --
    absent, the server's default; one it does not serve refused in one line naming the flag -- and
    its other static inputs' served values (``--input-values``: likewise)."""
    from preheat.errors import InvalidArgumentError
    from preheat.families.offer import served_sampler, served_size, served_statics

    sampler, refused = served_sampler(given.get("sampler"), pipe.defaults["sampler"], server.samplers)
    if refused:
        raise InvalidArgumentError(f"--sampler {refused} (the server's {names.samplers})", argument="--sampler")
    given = {**given, "sampler": sampler}
    specs = pipe.family.input_specs(pipe)
    pair = size_pair(specs)
    if pair is not None:
        call = served_size(pair, given, tuple(server.sizes) or pipe.family.served_sizes(pipe))  # the server's rule
        if call.refused is not None:
            flag = {s.name: s.cli_flag for s in specs}[call.refused]
            raise InvalidArgumentError(f"{flag}: {call.why} (the server's {names.sizes})", argument=flag)
        given = {**given, **pair.inputs(call.size)}
    statics = served_statics(specs, server.input_values, given)
    for spec, why in statics.refused:
        raise InvalidArgumentError(f"{spec.cli_flag} {why}", argument=spec.cli_flag)
    return {**given, **statics.filled}


def _check_offered(pipe: Any, model: str | None, inputs_text: str | None, opts: CallOptions) -> None:
    """``--inputs``: the declaration's offered inputs, resolved as `warm --inputs` resolves them
    (``preheat.warm.resolve``, ``offered_inputs``: the same one-line errors); a call giving an
    input it does not offer has no program there (warm compiles none; a server refuses the
    request): one line naming the flag and the ``--inputs`` that would offer it."""
    if inputs_text is None:
        return
    from preheat.errors import InvalidArgumentError
    from preheat.families.offer import inputs_offering, parse_offered
    from preheat.warm import WarmSet, offered_inputs, resolve

    offered = offered_inputs(pipe, resolve(pipe, WarmSet(model=model, inputs=parse_offered(inputs_text))))
    specs = {s.name: s for s in pipe.family.input_specs(pipe)}
    with flag_errors(pipe):
        given = opts.call_inputs(pipe)
    for name in offered.not_offered:
        if given.get(name) is None:
            continue
        names = inputs_offering(tuple(specs.values()), offered.optional, specs[name])
        flag = specs[name].cli_flag
        raise InvalidArgumentError(f"{flag}: --inputs {inputs_text} does not offer {name}: a server or warm job "
                                   f"declared so has no program for this call (--inputs {names} offers it)",
                                   argument=flag)


def _explain_torch(model: str | None, opts: CallOptions, inputs_text: str | None = None) -> None:
    """The torch key holds the denoiser's (or each block's) input signature, known only at its
    first call: so the call runs once, eagerly and for one step, with every compile replaced by a
    look-up of the key it would use."""
    import preheat

    load = {k: v for k, v in opts.load_options().items() if k not in ("backend", "compile", "cache")}
    pipe = preheat.load(model, backend="torch", compile=opts.compile_mode, cache="explain", **load)
    _check_offered(pipe, model, inputs_text, opts)
    with flag_errors(pipe):
        inputs = opts.call_inputs(pipe)
        # the fewest steps the call allows: one, or a given counted list's length (custom timesteps)
        counted = any(s.counts_steps and inputs.get(s.name) is not None for s in pipe.family.input_specs(pipe))
        inputs[STEPS.name] = None if counted else 1
        pipe.generate(opts.batch(pipe), **{k: v for k, v in inputs.items() if v is not None})
    for event in pipe.compiler.events:
        fields = event["fields"]
        what = f"{fields['mode']} {fields['model'].get('kind', '?')} {json.dumps(fields['shapes'], sort_keys=True)[:160]}"
        if event["explain"] == "hit":
            click.echo(f"hit: entry {event['key'][:12]} exists for {what}")
        elif event["nearest"] is None:
            click.echo(f"miss: key {event['key'][:12]} for {what}; the cache has no torch entries to compare with")
        else:
            click.echo(f"miss: key {event['key'][:12]} for {what}; nearest entry {event['nearest'][:12]} differs in: "
                       f"{', '.join(event['differs'])}")


@cache_group.command("prune")
@click.option("--older-than-days", type=NON_NEGATIVE, help="Also remove entries unused (remote: unpublished) for this long.")
@click.option("--remote", is_flag=True, help="Prune the shared store (PREHEAT_CACHE_URL / --cache-url) instead.")
@click.option("--max-gb", type=NON_NEGATIVE, help="--remote: retire the oldest entries until the store holds this much.")
@click.option("--protect-minutes", default=60.0, show_default=True, type=NON_NEGATIVE,
              help="--remote: never retire an entry published, nor delete an object written, this recently.")
@click.option("--dry-run", is_flag=True, help="--remote: say what would go; change nothing.")
@click.option("--drop-missing-sources", is_flag=True,
              help="Also remove conversions of single files outside the cache root that are missing (kept by "
                   "default: the drive may only be unmounted).")
@one_line_errors
def prune_command(older_than_days: float | None, remote: bool, max_gb: float | None, protect_minutes: float,
                  dry_run: bool, drop_missing_sources: bool) -> None:
    """Remove quarantined entries, stale temp folders, and old entries; then apply the size cap;
    then weights (snapshots, blobs) that no pulled source names, older than an hour, and the folders
    made from them (each one's line says why it goes or stays).

    With --remote: retire old entries of the shared store (and the oldest beyond --max-gb), then
    delete the objects no manifest names and the weight blobs no pod's ref names, safely while
    other pods read and write (see preheat.cache.remote.prune)."""
    from preheat.errors import InvalidArgumentError

    if remote and drop_missing_sources:
        raise InvalidArgumentError("--drop-missing-sources applies to the local cache root, not --remote")
    if not remote:
        if max_gb is not None or dry_run:
            raise InvalidArgumentError("--max-gb and --dry-run apply to --remote")
        from preheat.cache.manage import enforce_size_cap, prune
        from preheat.cache.root import resolve_root

        from preheat.store import collect_orphans, derived_folders

        root = resolve_root().path
        removed = prune(root, older_than_days) + enforce_size_cap(root)
        derived = derived_folders(root)  # why each folder made from model files goes or stays (before gc)
        orphans = collect_orphans(root, drop_missing_sources=drop_missing_sources)  # older than an hour
        for d in derived:
            gone = d.name in orphans
            if gone or d.state != "live":
                click.echo(f"{'collected' if gone else 'kept'} {d.name}: {_why(d, gone)}")
        click.echo(f"removed {len(removed)}" + (f"; {len(orphans)} unreferenced weight files" if orphans else ""))
        return
    from preheat.cache.remote import RemoteError, remote_from_env

    for name, value in (("--older-than-days", older_than_days), ("--max-gb", max_gb)):
        if value is not None and value < 0:
            raise InvalidArgumentError(f"{name} {value} must be >= 0")
    if protect_minutes < 0:
        raise InvalidArgumentError(f"--protect-minutes {protect_minutes} must be >= 0")
    store = remote_from_env(warm_up=False)
    if store is None:
        raise InvalidArgumentError("--remote needs PREHEAT_CACHE_URL (or --cache-url)")
    try:
        result = store.prune_remote(max_bytes=None if max_gb is None else int(max_gb * 1024**3),
                                    older_than_s=None if older_than_days is None else older_than_days * 86400,
                                    protect_s=protect_minutes * 60, dry_run=dry_run)
    except RemoteError as err:
        from preheat.errors import CacheError

        raise CacheError(f"cannot prune {store.url}: {err}") from None
    verb = "would retire" if dry_run else "retired"
    click.echo(f"{verb} {len(result['retired'])} entries, deleted {result['deleted_objects']} objects and "
               f"{result['deleted_blobs']} unreferenced weight blobs ({_human(result['freed_bytes'])}); "
               f"{len(result['kept_protected'])} kept (published within {protect_minutes:g} min); "
               f"{_human(result['live_bytes'])} live"
               + (f"; no weight blob collected: {result['blobs_skipped']}" if result["blobs_skipped"] else ""))


@cache_group.command("clear")
@click.option("--yes", is_flag=True, help="Do not ask.")
@one_line_errors
def clear_command(yes: bool) -> None:
    """Delete every compiled program (weights are kept)."""
    from preheat.cache.manage import clear
    from preheat.cache.root import resolve_root

    root = resolve_root().path
    if not yes:
        click.confirm(f"delete all compiled programs under {root}?", abort=True)
    click.echo(f"removed {clear(root)} entries")
