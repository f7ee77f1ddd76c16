"""`preheat train-digits`: train the built-in digits model."""

from __future__ import annotations

from pathlib import Path

import click

from preheat.cli._support import one_line_errors

__all__ = ["train_digits_command"]


@click.command("train-digits")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--steps", default=3000, show_default=True, type=click.IntRange(min=1))
@click.option("--batch", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**32 - 1))
@click.option("--lr", default=2e-3, show_default=True, type=click.FloatRange(min=0, min_open=True))
@one_line_errors
def train_digits_command(out: Path, steps: int, batch: int, seed: int, lr: float) -> None:
    """Train the built-in digits model (scikit-learn's load_digits) with optax."""
    from preheat.train.digits import train_digits

    path = train_digits(out, steps=steps, batch=batch, seed=seed, lr=lr, log=lambda s: click.echo(s, err=True))
    click.echo(f"wrote {path}")
