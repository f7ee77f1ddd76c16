"""How many device bytes a model's weights take at a dtype, from the safetensors headers alone.

A model that cannot fit the chip should be refused before a byte of it is read (a TPU v5e chip has
15.75 GiB of HBM; SDXL's 3.47 billion parameters take 12.9 GiB in float32 before any activation,
6.5 GiB in bfloat16; FLUX.1-dev's 16.9 billion take 31.5 GiB in bfloat16). The headers give
each tensor's shape and stored dtype; the load rules give the dtype it is placed in:

    denoiser (unet, transformer)  ``dtype``; a tensor stored in fp8 stays fp8; with ``weights_dtype``
                                  the Linear/Conv/Embedding weights diffusers' layerwise casting
                                  names (``preheat.models.storage``) in that dtype -- an estimate:
                                  a model's own extra skip patterns are not read
    text encoders                 ``dtype``; none with ``offload_encoders`` (host memory until they run)
    vae                           float32 when its config says ``force_upcast`` and ``dtype`` is half
    integer tensors               as stored
    anything else                 not counted (a safety checker, an image encoder: no family loads them)

So the figure never exceeds what a load places: the refusal it backs cannot refuse a model that fits.

Nothing here imports JAX at import time: ``preheat doctor --model`` reads it in-process;
``check_fits`` is the load's one-line refusal (it asks JAX for the devices only when not given them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from preheat.errors import ModelError, PreheatError
from preheat.models.safetensors_files import read_header, read_json, weight_files

__all__ = ["Footprint", "weight_footprint", "check_fits", "gib"]

DENOISERS = ("unet", "transformer")
_SKIP = re.compile(r"pos_embed|patch_embed|norm")  # storage.DEFAULT_SKIP, less the anchored two below
_SKIP_LINEAR = re.compile(r"pos_embed|patch_embed")  # weights_layers="linear": norm modules' Linears too
_SKIP_TOP = ("proj_in", "proj_out")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def gib(n: float) -> str:
    """Bytes as people read them: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class Footprint:
    """Device bytes per component (``parts``: name -> bytes) of one load."""

    root: Path
    dtype: str
    weights_dtype: str | None
    offload_encoders: bool
    parts: dict[str, int] = field(default_factory=dict)
    offloaded: dict[str, int] = field(default_factory=dict)  # encoders kept in host memory

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def options(self) -> str:
        """The load options this footprint is for, as the CLI spells them."""
        out = f"--dtype {self.dtype}"
        out += f" --weights-dtype {self.weights_dtype}" if self.weights_dtype else ""
        return out + (" and preheat.load(..., offload_encoders=True)" if self.offload_encoders else "")


def _layerwise(key: str, shape: tuple[int, ...], linear: bool = False) -> bool:
    """A weight diffusers' layerwise casting stores low (Linear, Conv, Embedding), by its key."""
    if not key.endswith(".weight") or len(shape) < 2:
        return False
    module = key[: -len(".weight")]
    return not (_SKIP_LINEAR if linear else _SKIP).search(module) and module not in _SKIP_TOP


def _component_bytes(folder: Path, variant: str | None, itemsize: int, low: int | None, linear: bool = False) -> int:
    total = 0
    for path in weight_files(folder, variant=variant):
        for key, info in read_header(path).items():
            n = int(np.prod(info.shape, dtype=np.int64))
            floating = info.dtype.kind == "f" or info.dtype.name == "bfloat16" or "float8" in info.dtype.name
            if not floating:
                total += info.nbytes  # integers and bools as stored
            elif info.dtype.itemsize == 1:
                total += n  # stored fp8 stays fp8
            elif low is not None and _layerwise(key, info.shape, linear):
                total += n * low
            else:
                total += n * itemsize
    return total


def _vae_upcast(folder: Path) -> bool:
    try:
        return bool(read_json(folder / "config.json").get("force_upcast", True))
    except PreheatError:
        return True


def weight_footprint(root: str | Path, dtype: str = "float32", *, variant: str | None = None,
                     weights_dtype: str | None = None, weights_layers: str = "layerwise",
                     offload_encoders: bool = False) -> Footprint:
    """The device bytes of ``root``'s weights at ``dtype`` (a one-line ``PreheatError`` when a
    component's files are missing or torn, as the load would raise)."""
    root = Path(root)
    dtype = str(dtype)
    if dtype not in _ITEMSIZE:
        raise ModelError(f"dtype {dtype!r} is not one of {', '.join(k for k in _ITEMSIZE if 'float8' not in k)}")
    size = _ITEMSIZE[dtype]
    low = _ITEMSIZE.get(weights_dtype) if weights_dtype else None
    linear = weights_layers == "linear"
    fp = Footprint(root, dtype, weights_dtype, offload_encoders)
    if not (root / "model_index.json").is_file():  # a bare model folder: the denoiser alone
        fp.parts[root.name or "model"] = _component_bytes(root, variant, size, low, linear)
        return fp
    index = read_json(root / "model_index.json", "pipeline index")
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or None in entry or not (root / name).is_dir():
            continue
        if name not in DENOISERS and name != "vae" and not name.startswith("text_encoder"):
            continue  # what the families do not load (safety_checker, image_encoder, ...): never counted
        if name == "vae":
            n = _component_bytes(root / name, variant, 4 if size < 4 and _vae_upcast(root / name) else size, None)
        else:
            n = _component_bytes(root / name, variant, size, low if name in DENOISERS else None, linear)
        (fp.offloaded if offload_encoders and name.startswith("text_encoder") else fp.parts)[name] = n
    return fp


def _device_limit(device: Any) -> int | None:
    try:
        stats = device.memory_stats() or {}
    except Exception:  # a backend without memory stats (the CPU)
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def check_fits(root: Path, *, dtype: Any, variant: str | None, weights_dtype: str | None, offload_encoders: bool,
               weights_layers: str = "layerwise", mesh: Any = None, fsdp: int = 1,
               devices: Sequence[Any] | None = None) -> None:
    """Refuse in one line a load whose weights alone exceed a device's memory, before any is read:
    on ``devices``, else the mesh's, else JAX's first device.

    Quiet whenever it cannot tell (no memory stats, files the loader will name in its own words)."""
    if devices is None:
        import jax

        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    limits = [lim for lim in (_device_limit(d) for d in devices) if lim]
    if not limits:
        return
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        fp = weight_footprint(root, name, variant=variant, weights_dtype=weights_dtype, weights_layers=weights_layers,
                              offload_encoders=offload_encoders)
    except (PreheatError, TypeError):
        return
    need, have = fp.total // max(fsdp, 1), min(limits)
    if need > have:
        per = f" each of {fsdp} devices" if fsdp > 1 else " the device"
        raise ModelError(f"{root}: its weights take {gib(need)} at {fp.options()}, more than the {gib(have)}{per} "
                         f"holds; `preheat doctor --model {root} --dtype {fp.dtype}` says which options fit")
