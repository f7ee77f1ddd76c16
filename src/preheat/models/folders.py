"""Finding the UNet inside a diffusers-format folder (no JAX, no flax, no torch: both backends use it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from preheat.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError, UnsupportedConfigError

__all__ = ["resolve_unet_dir", "pipeline_extras", "image_size", "class_count"]


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


def pipeline_extras(root: Path) -> dict[str, Any]:
    """preheat's section of ``model_index.json`` (null class, labels, sampling defaults), if any."""
    from preheat.models.safetensors_files import read_json

    index = root / "model_index.json"
    extras = read_json(index, "pipeline index").get("preheat", {}) if index.is_file() else {}
    if not isinstance(extras, dict):
        raise ModelFormatError(f"{index}: \"preheat\" must be a JSON object (null_class, labels, defaults)")
    return extras


def image_size(sample_size: Any, unet_dir: Path) -> tuple[int, int]:
    """(H, W) from a UNet config's ``sample_size`` (an int or a pair)."""
    if sample_size is None:
        raise InvalidArgumentError(f"{unet_dir / 'config.json'} has no sample_size; preheat needs the image size")
    return (sample_size, sample_size) if isinstance(sample_size, int) else tuple(sample_size)


def class_count(num_class_embeds: Any, class_embed_type: Any, null_class: Any) -> int | None:
    """Real classes of a class-conditional UNet, less preheat's null class when ``model_index.json``
    names one; None for an unconditional UNet.

    ``class_embed_type`` None: ``num_class_embeds`` rows of an embedding table. ``"timestep"``: the
    labels are integers fed through the time projection, so the table size says nothing, but
    ``num_class_embeds`` (which diffusers then ignores) says how many labels the model was trained
    with; without it there is no range to check labels against, and the folder is refused.
    ``"identity"``: the labels are embedding vectors (batch, time_embed_dim), which a class label
    cannot supply (``preheat.load_unet`` takes them).
    """
    if class_embed_type == "identity":
        raise UnsupportedConfigError("class_embed_type 'identity' takes embedding vectors as class labels, which "
                                     "preheat.load cannot supply; use preheat.load_unet and pass them yourself")
    if num_class_embeds is None:
        if class_embed_type == "timestep":
            raise UnsupportedConfigError("class_embed_type 'timestep' needs num_class_embeds in the UNet config: "
                                         "the number of integer labels the model takes")
        return None
    return int(num_class_embeds) - (1 if null_class is not None else 0)
