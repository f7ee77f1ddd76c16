"""Helpers for the store tests: a small diffusers-format folder, its files, tarballs of it."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def make_model(folder: Path, seed: int = 0) -> Path:
    """A small diffusers-style pipeline folder (not a valid UNet: the store does not care)."""
    rng = np.random.default_rng(seed)
    (folder / "unet").mkdir(parents=True)
    (folder / "scheduler").mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline", "unet": ["diffusers", "UNet2DModel"]}))
    (folder / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel", "sample_size": 8}))
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": "DDPMScheduler"}))
    # random float32: incompressible, so the tarball stays ~260 KB and downloads take several reads
    save_file({"conv_in.weight": rng.standard_normal((64, 1024), dtype=np.float32),
               "conv_in.bias": np.arange(8, dtype=np.float32)},
              str(folder / "unet" / "diffusion_pytorch_model.safetensors"))
    return folder


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def tar_bytes(folder: Path, top: str | None = "tiny-model", mode: str = "w:gz") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for rel, data in files_of(folder).items():
            info = tarfile.TarInfo(f"{top}/{rel}" if top else rel)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()
