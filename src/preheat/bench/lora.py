"""`preheat bench lora`: images/s for one batch with a different LoRA per image vs the same LoRA on
every image vs no LoRA (issue 15; goal: mixed >= 0.8x same), measured in one process, the
conditions interleaved round by round so that a shared machine's load falls on all of them alike.

Conditions, each one compiled program, every image the same prompt and steps:

    none        no LoRA: the program without adapters
    same        one LoRA given for the batch: 1 adapter slot
    same/slots  the same LoRA per image, as a server's batch gives it: n slots, one used
    mixed       n different LoRAs, one per image: n slots (each image gathers its own factors)

The LoRAs are random, of one rank, on every target layer of the denoiser (the most a LoRA can
touch: the upper bound of the per-image gather's cost). A whole ``generate`` call is timed
(text encoding, denoising, decoding; the LoRA files read and their factors stacked once, before
timing, as a server holding them would have them), and the denoising program alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from preheat.bench.common import (Condition, condition_rows, conditions_table, load_average, machine_line,
                                  time_interleaved)
from preheat.bench.random_models import materialize_model

__all__ = ["bench_lora", "write_random_loras", "markdown"]

CONDITIONS = ("none", "same", "same/slots", "mixed")


def write_random_loras(pipe: Any, directory: Path, count: int, rank: int, seed: int = 0) -> list[Path]:
    """``count`` random LoRA files of ``rank`` on every denoiser target layer, in diffusers' key names."""
    from safetensors.numpy import save_file

    targets = pipe.lora_runtime.targets
    prefix = "transformer" if "transformer" in targets.prefixes else "unet"
    layers = targets.layers["denoiser"]
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(count):
        rng = np.random.default_rng(seed + i)
        tensors = {}
        for name, (cin, cout) in layers.items():
            tensors[f"{prefix}.{name}.lora_A.weight"] = (rng.standard_normal((rank, cin)) / np.sqrt(cin)).astype(np.float32)
            tensors[f"{prefix}.{name}.lora_B.weight"] = (0.1 * rng.standard_normal((cout, rank)) / np.sqrt(rank)).astype(np.float32)
        path = directory / f"lora-{i}.safetensors"
        save_file(tensors, str(path))
        out.append(path)
    return out


def _calls(n: int, files: list[Path]) -> dict[str, dict[str, Any]]:
    return {"none": {}, "same": {"lora": str(files[0])},
            "same/slots": {"lora": [[str(files[0])]] * n},
            "mixed": {"lora": [[str(files[i % len(files)])] for i in range(n)]}}


def bench_lora(model: str | None, n: int, steps: int, rank: int, repeats: int, workdir: Path,
               dtype: str = "float32", size: tuple[int, int] | None = None) -> dict[str, Any]:
    import preheat

    pipe = preheat.load(materialize_model(model, workdir), cache="off", dtype=dtype)
    if pipe.lora_runtime is None:
        from preheat.errors import InvalidArgumentError

        raise InvalidArgumentError(f"LoRAs are not supported for a {pipe.family.name} model; bench a text-to-image "
                                   "model (e.g. random:sd-small)")
    files = write_random_loras(pipe, workdir / "loras", n, rank)
    # every file held, as a server holding them would, and every condition's stack too
    pipe.lora_runtime.hold(max_loras=n + 1, stack_slots=4 * n)
    base: dict[str, Any] = {"steps": steps, "seed": 0}
    from preheat.families.inputs import IMAGE_SIZE, example_inputs

    base.update(example_inputs(pipe.family.input_specs(pipe)))
    if size is not None:
        base.update(IMAGE_SIZE.inputs(size))
    timed = time_interleaved({name: Condition(pipe, {**base, **extra}) for name, extra in _calls(n, files).items()},
                             n, repeats)
    rows = [{**row, "slots": None if t.sig.lora is None else t.sig.lora[1],
             "bucket": None if t.sig.lora is None else t.sig.lora[0]}
            for row, t in zip(condition_rows(timed, n), timed.values())]
    by = {r["condition"]: r for r in rows}
    ratios = {
        "mixed_vs_same": by["mixed"]["images_per_s"] / by["same"]["images_per_s"],
        "mixed_vs_same_slots": by["mixed"]["images_per_s"] / by["same/slots"]["images_per_s"],
        "same_vs_none": by["same"]["images_per_s"] / by["none"]["images_per_s"],
        "mixed_vs_none": by["mixed"]["images_per_s"] / by["none"]["images_per_s"],
        "denoise_mixed_vs_same": by["same"]["denoise_s"]["median"] / by["mixed"]["denoise_s"]["median"],
    }
    return {"model": model or "built-in:digits", "family": pipe.family.name, "machine": machine_line(),
            "load_average": load_average(), "n": n, "steps": steps, "rank": rank,
            "target_layers": len(pipe.lora_runtime.targets.layers["denoiser"]), "dtype": dtype, "repeats": repeats,
            "sampler": pipe.defaults["sampler"], "guided": bool(timed["none"].sig.guided),
            "sample_shape": list(timed["none"].sig.sample_shape), "rows": rows, "ratios": ratios,
            "goal_met": ratios["mixed_vs_same"] >= 0.8}


def markdown(result: dict[str, Any]) -> str:
    load = result["load_average"]
    lines = [f"**{result['model']}** ({result['family']}), batch {result['n']}, {result['steps']} steps "
             f"{result['sampler']}{' +cfg' if result['guided'] else ''}, latents {result['sample_shape']}, LoRA rank "
             f"{result['rank']} on every target layer ({result['target_layers']}), {result['dtype']}, {result['repeats']} rounds — "
             f"{result['machine']}" + (f"; load average {load[0]:.1f}" if load else ""), "",
             *conditions_table(result["rows"], {"slots": lambda r: str(r["slots"] or "-")})]
    q = result["ratios"]
    lines += ["", f"mixed / same: **{q['mixed_vs_same']:.2f}×** (goal ≥ 0.8: {'met' if result['goal_met'] else 'NOT met'}); "
              f"mixed / same with the server's slot count: {q['mixed_vs_same_slots']:.2f}×; same / none: "
              f"{q['same_vs_none']:.2f}×; mixed / none: {q['mixed_vs_none']:.2f}×; denoising alone, mixed / same: "
              f"{q['denoise_mixed_vs_same']:.2f}×"]
    return "\n".join(lines)
