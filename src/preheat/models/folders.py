"""Finding the UNet inside a diffusers-format folder (no JAX, no flax, no torch: both backends use it)."""

from __future__ import annotations

from pathlib import Path

from preheat.errors import ModelNotFoundError

__all__ = ["resolve_unet_dir"]


def resolve_unet_dir(path: str | Path) -> Path:
    """The folder holding the UNet's config.json, from a UNet folder or a pipeline folder."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"model path {p} does not exist")
    if not p.is_dir():
        raise ModelNotFoundError(f"model path {p} is not a folder (expected a diffusers-format folder)")
    if (p / "model_index.json").is_file() or (p / "unet").is_dir():
        p = p / "unet"
        if not p.is_dir():
            raise ModelNotFoundError(f"pipeline folder {p.parent} has model_index.json but no unet/ folder")
    if not (p / "config.json").is_file():
        raise ModelNotFoundError(f"{p} has no config.json (expected a diffusers UNet2DModel folder)")
    return p
