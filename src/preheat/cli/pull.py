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

    SOURCE a single-file checkpoint (.safetensors, or a FLUX.1 transformer's .gguf; local, or
    hf://org/repo/file) of a published model: it is stored, and
    the folders it lacks (its tokenizers; a transformer file's VAE and text encoders) are pulled
    from that model's published repository, nothing else; --dry-run lists them (for a remote file,
    read from its header alone).
    """
    from preheat.model_source import RANDOM_PREFIX, model_root
    from preheat.store import plan_pull, pull

    try:
        if source.startswith(RANDOM_PREFIX):  # built here, once, under the cache root
            path = model_root(source)
        elif _remote_file(source):
            _pull_remote_file(source, revision, config, variant, dry_run, quiet, force)
            return
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

    from preheat.store import is_remote

    if is_remote(source) or not source.lower().endswith((".safetensors", ".gguf")) or not Path(source).is_file():
        return None
    return Path(source) if _of_published_model(Path(source), config) else None


def _of_published_model(file: "Path", config: str | None) -> bool:
    """Whether single ``file`` is read as a published model (``--config`` NAME, checked to be one;
    else inferred from its header): then what it lacks is pulled with it."""
    from preheat.errors import MissingExtraError, ModelFormatError
    from preheat.models.published import PUBLISHED, infer_file, named

    if config is not None:
        if named(config) is None:
            names = ", ".join(p.name for p in PUBLISHED)
            raise InvalidArgumentError(f"--config names a published model ({names}); not {config!r}",
                                       argument="config")
        return True
    try:
        infer_file(file)
    except (ModelFormatError, MissingExtraError):
        return False  # no published model (or a GGUF without the gguf extra to read it): stored as one file
    return True


def _remote_file(source: str) -> bool:
    """``hf://org/repo/path/file.safetensors`` or ``.gguf``: one file of a repository."""
    from preheat.store import is_remote, parse_source

    if not (is_remote(source) and source.lower().startswith("hf://")):
        return False
    filename = parse_source(source).filename
    return filename is not None and filename.lower().endswith((".safetensors", ".gguf"))


def _pull_remote_file(source: str, revision: str | None, config: str | None, variant: str | None, dry_run: bool,
                      quiet: bool, force: bool) -> None:
    """A remote single file as a local one is pulled: the file, and, when it is of a published
    model (its header read; ``--config`` NAME), the folders it lacks. A dry run reads the header
    alone (``single_file_head``: Range requests) and lists both plans; a file of no published model
    (a LoRA) is the file alone."""
    import tempfile
    from pathlib import Path

    from preheat.file_configs import single_file_config, single_file_head, single_file_plan
    from preheat.models.single_file import single_file_path
    from preheat.store import plan_pull, pull

    if dry_run:
        own = plan_pull(source, revision=revision)
        click.echo(f"{own.source.text} is one file of hf://{own.source.repo_id}; a pull fetches:")
        _print_plan(own)
        with tempfile.TemporaryDirectory(prefix="preheat-head-") as tmp:
            head = single_file_head(own, Path(tmp))  # its header's bytes only
            if _of_published_model(head, config):
                plan, needs = single_file_plan(head, config, variant)
                click.echo(f"{own.source.text} is a {needs.published.title} single file; it needs these files of "
                           f"{plan.source.text}:")
                _print_plan(plan)
        return
    path = pull(source, revision=revision, progress=not quiet, force=force)
    file = single_file_path(path)
    if file is not None and _of_published_model(file, config):
        folder = single_file_config(file, config, variant)
        if not quiet:
            click.echo(f"configs and the folders it lacks: {folder}", err=True)
    click.echo(str(path))
