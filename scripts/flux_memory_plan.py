"""FLUX.1-dev's memory plan on one TPU v5e chip, from the published configs: no weight is written.

    PYTHONPATH=src python scripts/flux_memory_plan.py [--json]

Each component (transformer, T5-XXL, CLIP-L, VAE) is built abstractly from the configs preheat
ships for single files (``preheat.models.published``), and written as a safetensors file whose
header is the real one (bfloat16, diffusers' names and shapes) and whose data is a hole (a
sparse file: no disk used, nothing read). ``preheat.models.footprint`` then sizes it exactly as
``preheat doctor --model`` and ``preheat.load``'s refusal size a downloaded folder, at each load
option, against the chip's HBM (``memory_stats()["bytes_limit"]`` measured on the v5e: 15.75 GiB).
docs/tpu.md's "FLUX.1 on a v5e: the plan" is this script's output. CPU only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

HBM = 16_909_336_064  # bytes_limit of the v5e chip (tests/_support/tpu_fixtures.py)
OPTIONS = [  # (dtype, weights_dtype, weights_layers, offload_encoders, encoders_on)
    ("bfloat16", None, "layerwise", False, "device"),
    ("bfloat16", None, "layerwise", True, "device"),
    ("bfloat16", "float8_e4m3fn", "layerwise", True, "device"),
    ("bfloat16", "int8", "layerwise", True, "device"),
    ("bfloat16", "float8_e4m3fn", "linear", True, "device"),
    ("bfloat16", "int8", "linear", True, "device"),
    ("bfloat16", "int8", "layerwise", False, "host"),
    ("bfloat16", "int8", "linear", False, "host"),
]


def _header_only(folder: Path, stem: str, build: Callable[[], tuple[Any, Any]], rename: Callable[[str], str] = str,
                 config: dict[str, Any] | None = None) -> int:
    """One bfloat16 safetensors file of ``build``'s parameters, its data a hole; returns the count."""
    import jax
    import numpy as np

    from preheat.models.weights import _LEAF_TO_TORCH, expected_torch_shape, torch_key

    _, state = build()
    header: dict[str, Any] = {}
    offset = count = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        names = tuple(n for n in (getattr(p, "key", getattr(p, "name", getattr(p, "idx", p))) for p in path)
                      if n != "value")
        if str(names[-1]) not in _LEAF_TO_TORCH:
            continue
        shape = expected_torch_shape(tuple(leaf.shape), str(names[-1]))
        n = int(np.prod(shape, dtype=np.int64))
        header[rename(torch_key(names))] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + 2 * n]}
        offset += 2 * n
        count += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {}))
    with open(folder / f"{stem}.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # the data: a hole
    return count


def write_flux_dev(root: Path) -> dict[str, int]:
    """A header-only FLUX.1-dev folder at ``root``; returns each component's parameter count."""
    from preheat.models import clip, flux, t5, vae
    from preheat.models.published import CONFIGS

    src = CONFIGS / "FLUX.1-dev"
    cfg = {name: json.loads((src / name / "config.json").read_text())
           for name in ("transformer", "text_encoder", "text_encoder_2", "vae")}
    shutil.copy(src / "model_index.json", root / "model_index.json")
    return {
        "transformer": _header_only(root / "transformer", "diffusion_pytorch_model", lambda: flux.build_abstract(
            flux.FluxTransformerConfig.from_dict(cfg["transformer"], "FLUX.1-dev")), config=cfg["transformer"]),
        "text_encoder_2": _header_only(root / "text_encoder_2", "model", lambda: t5.build_abstract(
            t5.T5Config.from_dict(cfg["text_encoder_2"], "FLUX.1-dev")), config=cfg["text_encoder_2"]),
        "text_encoder": _header_only(root / "text_encoder", "model", lambda: clip.build_abstract(
            clip.CLIPTextConfig.from_dict(cfg["text_encoder"], "FLUX.1-dev")), config=cfg["text_encoder"]),
        "vae": _header_only(root / "vae", "diffusion_pytorch_model", lambda: vae.build_abstract(
            vae.AutoencoderKLConfig.from_dict(cfg["vae"], "FLUX.1-dev")), config=cfg["vae"]),
    }


def main() -> None:
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # shapes only: never start an accelerator's runtime
    from preheat.models.footprint import fitting, gib, weight_footprint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the plans")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="flux-plan-"))
    try:
        params = write_flux_dev(root)
        rows = []
        for dtype, wd, layers, off, on in OPTIONS:
            fp = weight_footprint(root, dtype, weights_dtype=wd, weights_layers=layers, offload_encoders=off,
                                  encoders_on=on)
            rows.append({"options": fp.options(), "parts": fp.parts, "offloaded": fp.offloaded, "host": fp.host,
                         "total": fp.total,
                         "peak": fp.peak, "fits": fp.fits(HBM), "plan": fp.plan(HBM, "one v5e chip")})
        best = fitting(root, HBM, dtype="bfloat16", prefer="int8")
        resting = fitting(root, HBM, dtype="bfloat16", prefer="int8", encoding=False)
        out = {"params": params, "bytes_limit": HBM, "rows": rows, "fitting": best.options() if best else None,
               "fitting_while_denoising": resting.options() if resting else None}
        if args.json:
            print(json.dumps(out, indent=1))
            return
        print("parameters: " + ", ".join(f"{k} {v / 1e9:.3f} B" for k, v in params.items()))
        for row in rows:
            print(f"\n{row['options']}: {'fits' if row['fits'] else 'does not fit'} "
                  f"({gib(row['total'])} at rest, {gib(row['peak'])} while encoding)")
            print("\n".join(f"  {line}" for line in row["plan"]))
        print(f"\nfirst option that fits: {out['fitting']}; while denoising alone: {out['fitting_while_denoising']}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
