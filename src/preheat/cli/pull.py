"""``preheat pull SOURCE``: put a model into the store and print its snapshot folder."""

from __future__ import annotations

import sys

import click

from preheat.errors import InvalidArgumentError, PreheatError

__all__ = ["pull_command"]


@click.command("pull")
@click.argument("source")
@click.option("--revision", default=None, help="hf:// only: branch, tag or commit (same as SOURCE@REVISION).")
@click.option("--force", is_flag=True, help="Fetch again even if already stored; re-checks every blob (repairs).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar; print only the snapshot path.")
def pull_command(source: str, revision: str | None, force: bool, quiet: bool) -> None:
    """Put SOURCE into the store (under the cache root) and print its snapshot folder.

    SOURCE is a local folder or .tar(.gz) file, an http(s):// URL of a .tar/.tar.gz/.tgz of a
    diffusers folder (or of one file; append #sha256=<hex> to check it), hf://org/repo[@revision],
    or random:NAME (a random-weight folder, written once: random:sd1-tiny, random:sdxl-tiny,
    random:sd3-tiny, random:flux-tiny, random:sd15, ...).
    Already-stored remote sources are not downloaded again; an interrupted download resumes.
    """
    from preheat.cli._support import resolve_model
    from preheat.store import pull

    try:
        if source.startswith("random:"):  # built here, once, under the cache root
            path = resolve_model(source, log=lambda line: click.echo(line, err=True) if not quiet else None).model
        else:
            path = pull(source, revision=revision, progress=not quiet, force=force)
    except PreheatError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2 if isinstance(err, InvalidArgumentError) else 1)
    except KeyboardInterrupt:
        click.echo("error: interrupted (run the same pull again to resume)", err=True)
        sys.exit(130)
    click.echo(str(path))
