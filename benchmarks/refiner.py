"""Images/s of an SDXL call whose last steps a refiner takes over (the
ensemble of experts, ``preheat.families.experts``) against the base alone, measured in one process,
the conditions interleaved round by round so that a shared machine's load falls on all of them alike.

Conditions, every image the same prompt, steps and size:

    base        the base model loaded alone
    ensemble    the base with a refiner, denoising_end 0.8: the refiner runs the last steps
    base only   the same pipeline with denoising_end 1: the refiner held, never run -- what holding
                it costs a call (its encoder still runs; each step picks its UNet with ``lax.cond``)

The refiner is random, made from the base's own UNet config with a refiner's conditioning (its
text encoder's width, five time ids) and the base's second text encoder. A whole ``generate`` call
is timed (text encoding, denoising, decoding), and the denoising program alone.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import click

from benchmarks._common import condition_header, header_line, plain_call
from preheat.bench.common import Condition, condition_rows, conditions_table, ratio, time_interleaved, write_json
from preheat.bench.random_models import materialize_model
from preheat.cli._support import one_line_errors
from preheat.cli.options import POSITIVE, common_option, echo_result, output_options, size_options

__all__ = ["bench_refiner", "write_random_refiner", "markdown"]


def write_random_refiner(folder: Path, into: Path, seed: int = 0) -> Path:
    """An SDXL refiner folder for the base in ``folder``: a random UNet of the base's widths taking the
    second encoder's context and five time ids (original size, crop, aesthetic score), beside copies
    of the base's second encoder, its tokenizer, scheduler and VAE; ``requires_aesthetics_score``."""
    import diffusers
    import torch
    from diffusers import UNet2DConditionModel

    folder, into = Path(folder), Path(into)
    unet = json.loads((folder / "unet" / "config.json").read_text())
    encoder = json.loads((folder / "text_encoder_2" / "config.json").read_text())
    width = encoder.get("text_config", encoder)["hidden_size"]
    projection = encoder.get("projection_dim", width)
    config = {k: v for k, v in unet.items() if not k.startswith("_")}
    config.update(cross_attention_dim=width,
                  projection_class_embeddings_input_dim=projection + 5 * config["addition_time_embed_dim"])
    torch.manual_seed(seed)
    UNet2DConditionModel(**config).save_pretrained(into / "unet")
    for part in ("text_encoder_2", "tokenizer_2", "scheduler", "vae"):
        shutil.copytree(folder / part, into / part)
    base = json.loads((folder / "model_index.json").read_text())
    index = {"_class_name": "StableDiffusionXLImg2ImgPipeline", "_diffusers_version": diffusers.__version__,
             "requires_aesthetics_score": True, "force_zeros_for_empty_prompt": False,
             "text_encoder": [None, None], "tokenizer": [None, None],
             **{part: base[part] for part in ("text_encoder_2", "tokenizer_2", "unet", "vae", "scheduler")}}
    (into / "model_index.json").write_text(json.dumps(index, indent=2))  # last: it marks the folder complete
    return into


def bench_refiner(model: str | None, n: int, steps: int, repeats: int, workdir: Path,
                  dtype: str = "float32", size: tuple[int, int] | None = None) -> dict[str, Any]:
    import preheat
    from preheat.errors import InvalidArgumentError

    folder = materialize_model(model, workdir)
    index = {} if folder is None else json.loads((Path(folder) / "model_index.json").read_text())
    if index.get("_class_name") != "StableDiffusionXLPipeline":
        raise InvalidArgumentError(f"{model or 'the built-in model'} is not an SDXL base; bench an SDXL folder "
                                   "(e.g. random:sdxl-tiny)")
    refiner = write_random_refiner(Path(folder), workdir / "refiner")
    alone = preheat.load(folder, cache="off", dtype=dtype)
    ensemble = preheat.load(folder, cache="off", dtype=dtype, refiner=str(refiner))
    common, (width, height) = plain_call(alone, steps, size)
    conditions = {"base": Condition(alone, common),
                  "ensemble": Condition(ensemble, {**common, "denoising_end": 0.8}),
                  "base only": Condition(ensemble, {**common, "denoising_end": 1.0})}
    timed = time_interleaved(conditions, n, repeats)
    rows = condition_rows(timed, n)
    ratios = {"ensemble_vs_base": ratio(rows, "ensemble", "base"), "held_vs_base": ratio(rows, "base only", "base"),
              "denoise_ensemble_vs_base": ratio(rows, "ensemble", "base", "denoise_s")}
    return {**condition_header(model, alone, timed["base"].sig, n, steps, dtype, repeats, (width, height)),
            "rows": rows, "ratios": ratios}


def markdown(result: dict[str, Any]) -> str:
    lines = [header_line(result, "a random refiner of its UNet's widths"), "", *conditions_table(result["rows"])]
    q = result["ratios"]
    lines += ["", f"the ensemble (denoising_end 0.8) / the base alone: **{q['ensemble_vs_base']:.2f}×** images/s "
              f"(denoising alone takes {q['denoise_ensemble_vs_base']:.2f}× as long); the refiner held but not run "
              f"(denoising_end 1) / the base alone: {q['held_vs_base']:.2f}×"]
    return "\n".join(lines)


@click.command()
@click.argument("model", required=False, default="random:sdxl-tiny")
@common_option("n", default=2, help="Batch size.")
@common_option("steps", default=10, help="Denoising steps.")
@click.option("--repeats", default=5, show_default=True, type=POSITIVE, help="Rounds, each timing every condition once.")
@click.option("--dtype", default="float32", show_default=True)
@size_options()
@output_options()
@one_line_errors
def main(model: str, n: int, steps: int, repeats: int, dtype: str, size: tuple[int, int] | None,
         json_out: Path | None, as_json: bool) -> None:
    """Images/s of an SDXL call that a refiner finishes (the ensemble of experts, denoising_end 0.8) vs
    the base alone, and with the refiner held but not run, in one run. MODEL: an SDXL base folder, or
    random:sdxl-tiny / random:sdxl (random weights); the refiner is a random one of its UNet's widths."""
    with tempfile.TemporaryDirectory() as tmp:
        result = bench_refiner(model, n, steps, repeats, Path(tmp), dtype=dtype, size=size)
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)


if __name__ == "__main__":
    main()
