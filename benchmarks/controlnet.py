"""Images/s of a text-to-image call with a ControlNet beside the UNet
against the same call without one, measured in one process, the conditions interleaved round by
round so that a shared machine's load falls on all of them alike.

Conditions, each one compiled program, every image the same prompt, steps and control image:

    none         the model alone
    controlnet   a ControlNet on every step (scale 1, the whole window)
    window       the same ControlNet with control_guidance_end 0.5: the window is data (one
                 program serves every window), so the ControlNet still runs on every step and
                 its residuals are scaled by 0 outside it -- what that costs, measured

The ControlNet is random, made from the model's own UNet (diffusers' ``ControlNetModel.from_unet``,
its zero convs moved off zero). A whole ``generate`` call is timed (text encoding, denoising,
decoding), and the denoising program alone.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import click
import numpy as np

from benchmarks._common import condition_header, header_line, plain_call
from preheat.bench.common import Condition, condition_rows, conditions_table, ratio, time_interleaved, write_json
from preheat.bench.random_models import materialize_model
from preheat.cli._support import one_line_errors
from preheat.cli.options import POSITIVE, common_option, echo_result, output_options, size_options

__all__ = ["bench_controlnet", "write_random_controlnet", "markdown"]


def write_random_controlnet(folder: Path, into: Path, seed: int = 0) -> Path:
    """A ControlNetModel folder for ``folder``'s UNet, with random weights that steer (zero convs off
    zero); its control embedding downsamples as the folder's VAE does (diffusers' (16, 32, 96, 256):
    8 pixels a latent; a tiny VAE's 2: (16, 32))."""
    import json

    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    vae = json.loads((Path(folder) / "vae" / "config.json").read_text())
    downsamplings = len(vae.get("block_out_channels", (0, 0, 0, 0))) - 1  # the VAE's 2 ** this pixels a latent
    torch.manual_seed(seed)
    unet = UNet2DConditionModel.from_pretrained(Path(folder) / "unet")
    model = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32, 96, 256)[:downsamplings + 1])
    model = model.eval()
    zeroed = ("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding.conv_out")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(zeroed):
                p.normal_(0.0, 0.02)
    model.save_pretrained(into)
    return into


def bench_controlnet(model: str | None, n: int, steps: int, repeats: int, workdir: Path,
                     dtype: str = "float32", size: tuple[int, int] | None = None) -> dict[str, Any]:
    import preheat
    from preheat.errors import InvalidArgumentError

    folder = materialize_model(model, workdir)
    if folder is None or not (Path(folder) / "unet").is_dir():
        raise InvalidArgumentError(f"{model or 'the built-in model'} has no UNet for a ControlNet; bench an SD 1.x/2.x "
                                   "or SDXL folder (e.g. random:sd-small)")
    controlnet = write_random_controlnet(Path(folder), workdir / "controlnet")
    plain = preheat.load(folder, cache="off", dtype=dtype)
    controlled = preheat.load(folder, cache="off", dtype=dtype, controlnet=str(controlnet))
    base, (width, height) = plain_call(plain, steps, size)
    image = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)  # its content is data
    conditions = {"none": Condition(plain, base),
                  "controlnet": Condition(controlled, {**base, "control_image": image}),
                  "window": Condition(controlled, {**base, "control_image": image, "control_guidance_end": 0.5})}
    timed = time_interleaved(conditions, n, repeats)
    rows = condition_rows(timed, n)
    ratios = {"controlnet_vs_none": ratio(rows, "controlnet", "none"),
              "window_vs_controlnet": ratio(rows, "window", "controlnet"),
              "denoise_controlnet_vs_none": ratio(rows, "controlnet", "none", "denoise_s")}
    return {**condition_header(model, plain, timed["none"].sig, n, steps, dtype, repeats, (width, height)),
            "rows": rows, "ratios": ratios}


def markdown(result: dict[str, Any]) -> str:
    lines = [header_line(result, "a random ControlNet from its UNet"), "", *conditions_table(result["rows"])]
    q = result["ratios"]
    lines += ["", f"with a ControlNet / without: **{q['controlnet_vs_none']:.2f}×** images/s (denoising alone takes "
              f"{q['denoise_controlnet_vs_none']:.2f}× as long); a window of half the steps / the whole: "
              f"{q['window_vs_controlnet']:.2f}× (the window is data: the ControlNet runs on every step)"]
    return "\n".join(lines)


@click.command()
@click.argument("model", required=False, default="random:sd-small")
@common_option("n", default=4, help="Batch size.")
@common_option("steps", default=4, help="Denoising steps.")
@click.option("--repeats", default=5, show_default=True, type=POSITIVE, help="Rounds, each timing every condition once.")
@click.option("--dtype", default="float32", show_default=True)
@size_options()
@output_options()
@one_line_errors
def main(model: str, n: int, steps: int, repeats: int, dtype: str, size: tuple[int, int] | None,
         json_out: Path | None, as_json: bool) -> None:
    """Images/s of a call with a ControlNet beside the UNet vs without one, and with the ControlNet's
    window at half the steps, in one run. MODEL: an SD 1.x/2.x or SDXL folder, or random:sd-small /
    random:sd15 / random:sdxl (random weights); the ControlNet is a random one made from its UNet."""
    with tempfile.TemporaryDirectory() as tmp:
        result = bench_controlnet(model, n, steps, repeats, Path(tmp), dtype=dtype, size=size)
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)


if __name__ == "__main__":
    main()
