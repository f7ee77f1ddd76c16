"""``preheat pull SOURCE``: put a model into the store and print its snapshot folder."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from preheat.errors import InvalidArgumentError, PreheatError

if TYPE_CHECKING:
    from pathlib import Path

    from preheat.store import HfPlan

__all__ = ["pull_command"]


@click.command("pull")
@click.argument("source")
@click.option("--revision", default=None, help="hf:// only: branch, tag or commit (same as SOURCE@REVISION).")
@click.option("--force", is_flag=True, help="Fetch again even if already stored; re-checks every blob (repairs).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar; print only the snapshot path.")
@click.option("--variant", default=None, help="hf:// pipelines: pull this weight variant (e.g. fp16) instead of the default weights.")
@click.option("--dry-run", is_flag=True, help="hf:// and single files: list the files and bytes a pull would fetch; "
                                               "download nothing.")
@click.option("--config", default=None, metavar="NAME",
              help="A single file: the published model to read it as (stable-diffusion-2-1-base); default: inferred "
                   "from its tensors.")
def pull_command(source: str, revision: str | None, force: bool, quiet: bool, variant: str | None, dry_run: bool,
                 config: str | None) -> None:
    """Put SOURCE into the store (under the cache root) and print its snapshot folder.

    SOURCE is a local folder or .tar(.gz) file, an http(s):// URL of a .tar/.tar.gz/.tgz of a
    diffusers folder (or of one file; append #sha256=<hex> to check it), hf://org/repo[@revision],
    or random:NAME (a random-weight folder, written once: random:sd1-tiny, random:sdxl-tiny,
    random:sd3-tiny, random:flux-tiny, random:sd15, ...).
    Already-stored remote sources are not downloaded again; an interrupted download resumes.
    An hf:// pipeline pulls only model_index.json and, in the component folders it names, the
    configs, tokenizer files and one variant's safetensors; hf://org/repo/path/file.safetensors
    pulls that one file.

    SOURCE a local single-file checkpoint (.safetensors, or a FLUX.1 transformer's .gguf) of a published model: it is stored, and
    the folders it lacks (its tokenizers; a transformer file's VAE and text encoders) are pulled
    from that model's published repository, nothing else; --dry-run lists them.
    """
    from preheat.cli._support import resolve_model
    from preheat.store import plan_pull, pull

    try:
        if source.startswith("random:"):  # built here, once, under the cache root
            path = resolve_model(source, log=lambda line: click.echo(line, err=True) if not quiet else None).model
        elif (single := _single_file(source, config)) is not None:
            from preheat.file_configs import single_file_config, single_file_plan

            if dry_run:
                plan, needs = single_file_plan(single, config, variant)
                click.echo(f"{single} is a {needs.published.title} single file; it needs these files of "
                           f"{plan.source.text}:")
                _print_plan(plan)
                return
            path = pull(source, progress=not quiet, force=force)
            folder = single_file_config(single, config, variant)
            if not quiet:
                click.echo(f"configs and the folders it lacks: {folder}", err=True)
        elif dry_run:
            _print_plan(plan_pull(source, revision=revision, variant=variant))
            return
        else:
            path = pull(source, revision=revision, progress=not quiet, force=force, variant=variant)
    except PreheatError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2 if isinstance(err, InvalidArgumentError) else 1)
    except KeyboardInterrupt:
        click.echo("error: interrupted (run the same pull again to resume)", err=True)
        sys.exit(130)
    click.echo(str(path))


def _print_plan(plan: "HfPlan") -> None:
    """One line per file (bytes, path), then the total against the whole repository."""
    for f in plan.files:
        click.echo(f"{f.size:>15,d}  {f.path}")
    skipped = len(plan.repo_files) - len(plan.files)
    click.echo(f"{plan.bytes:>15,d}  total: {len(plan.files)} files of {plan.source.key} at {plan.commit} "
               f"({skipped} files, {plan.repo_bytes - plan.bytes:,d} bytes of the repository left out)")


def _single_file(source: str, config: str | None) -> "Path | None":
    """A local ``.safetensors`` or ``.gguf`` SOURCE that is pulled with what it lacks: one of a
    published model (inferred from its header, or ``--config`` NAME); None for anything else
    (pulled as it is: a LoRA, a folder, a GGUF of no published model)."""
    from pathlib import Path

    from preheat.errors import MissingExtraError, ModelFormatError
    from preheat.models.published import PUBLISHED, infer_file, named
    from preheat.store import is_remote

    if is_remote(source) or not source.lower().endswith((".safetensors", ".gguf")) or not Path(source).is_file():
        return None
    if config is not None:
        if named(config) is None:
            names = ", ".join(p.name for p in PUBLISHED)
            raise InvalidArgumentError(f"--config names a published model ({names}); not {config!r}",
                                       argument="config")
        return Path(source)
    try:
        infer_file(source)
    except (ModelFormatError, MissingExtraError):
        return None  # no published model (or a GGUF without the gguf extra to read it): stored as one file
    return Path(source)
