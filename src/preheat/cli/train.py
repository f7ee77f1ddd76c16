"""`preheat train-digits` / `preheat train-text-digits`: train the built-in models."""

from __future__ import annotations

from pathlib import Path

import click

from preheat.cli._support import one_line_errors

__all__ = ["train_digits_command", "train_text_digits_command"]


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


# the defaults are TextDigitsConfig's (not imported here: it imports jax), the shipped model's run
@click.command("train-text-digits")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--vae-steps", default=400, show_default=True, type=click.IntRange(min=1))
@click.option("--unet-steps", default=5000, show_default=True, type=click.IntRange(min=1),
              help="UNet and text-encoder steps (the shipped model's run: about 35 minutes on 2 CPU cores).")
@click.option("--batch", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**31 - 4))
@click.option("--lr", default=2e-3, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--tiny", is_flag=True, help="A few-step run of a narrower model (checks the command, draws nothing).")
@click.option("--check/--no-check", default=True, show_default=True,
              help="Score 100 samples with an SVC digit classifier and write the result into the model card.")
@one_line_errors
def train_text_digits_command(out: Path, vae_steps: int, unet_steps: int, batch: int, seed: int, lr: float,
                              tiny: bool, check: bool) -> None:
    """Train the built-in text-to-image model (a tiny Stable Diffusion on load_digits) with optax."""
    from preheat.train.text_digits import TINY, TextDigitsConfig, record_agreement, train_text_digits

    base = TINY if tiny else TextDigitsConfig()
    config = base._replace(seed=seed, lr=lr, **({} if tiny else {"vae_steps": vae_steps, "unet_steps": unet_steps,
                                                                  "batch": batch}))
    path = train_text_digits(out, config, log=lambda s: click.echo(s, err=True))
    if check:
        agreement = record_agreement(path, config)
        click.echo(f"classifier agreement {agreement.accuracy:.0%} of {agreement.samples}; mean ink bold "
                   f"{agreement.bold_ink:.3f}, thin {agreement.thin_ink:.3f}", err=True)
    click.echo(f"wrote {path}")
