"""Load diffusers-format UNet2DModel folders into JAX, without torch and without random init.

The module is built abstractly (``nnx.eval_shape``: shapes only, no computation), every
parameter leaf is then filled from the safetensors file, converted from torch layout.
Nothing is returned until every tensor has been checked, so a bad checkpoint never yields a
half-loaded model.

Accepted folders:
    <dir>/config.json + diffusion_pytorch_model.safetensors   (a bare UNet folder)
    <dir>/model_index.json + <dir>/unet/...                    (a pipeline folder)
Sharded checkpoints (``diffusion_pytorch_model.safetensors.index.json``) are read too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preheat.errors import ModelNotFoundError, UnsupportedConfigError, WeightsError
from preheat.models.folders import resolve_unet_dir
from preheat.models.unet2d import UNet2DConfig, UNet2DModel

__all__ = ["UNet2D", "load_unet", "resolve_unet_dir", "read_unet_config", "build_abstract", "torch_key"]

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"

# Old diffusers attention names, still found in published checkpoints (e.g. google/ddpm-*).
_DEPRECATED_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
_LEAF_TO_TORCH = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias", "weight": "weight"}


def read_unet_config(unet_dir: Path) -> UNet2DConfig:
    try:
        raw = json.loads((unet_dir / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise UnsupportedConfigError(f"{unet_dir / 'config.json'} is not valid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(raw, dict):
        raise UnsupportedConfigError(f"{unet_dir / 'config.json'} must hold a JSON object")
    cls = raw.get("_class_name", "UNet2DModel")
    if cls != "UNet2DModel":
        raise UnsupportedConfigError(f"unsupported model class {cls!r} in {unet_dir / 'config.json'}; supported: 'UNet2DModel'")
    return UNet2DConfig.from_dict(raw)


def build_abstract(config: UNet2DConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and a State of ShapeDtypeStructs; costs no FLOPs and no memory."""
    abstract = nnx.eval_shape(lambda: UNet2DModel(config, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def torch_key(path: tuple[Any, ...]) -> str:
    """NNX parameter path -> diffusers state-dict key."""
    *mods, leaf = (str(p) for p in path)
    return ".".join([*mods, _LEAF_TO_TORCH[leaf]])


def _to_jax_layout(arr: np.ndarray, leaf: str) -> np.ndarray:
    if leaf == "kernel" and arr.ndim == 4:  # conv: (O, I, kH, kW) -> (kH, kW, I, O)
        return arr.transpose(2, 3, 1, 0)
    if leaf == "kernel" and arr.ndim == 2:  # linear: (out, in) -> (in, out)
        return arr.T
    return arr


def _expected_torch_shape(shape: tuple[int, ...], leaf: str) -> tuple[int, ...]:
    if leaf == "kernel" and len(shape) == 4:
        kh, kw, i, o = shape
        return (o, i, kh, kw)
    if leaf == "kernel" and len(shape) == 2:
        return (shape[1], shape[0])
    return tuple(shape)


def _weight_files(unet_dir: Path) -> list[Path]:
    single = unet_dir / WEIGHTS_NAME
    if single.is_file():
        return [single]
    index = unet_dir / INDEX_NAME
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (unet_dir / s).is_file()]
        if missing:
            raise ModelNotFoundError(f"{unet_dir} is missing shard file(s) {', '.join(missing)} listed in {INDEX_NAME}")
        return [unet_dir / s for s in shards]
    if (unet_dir / "diffusion_pytorch_model.bin").is_file():
        raise ModelNotFoundError(
            f"{unet_dir} has only diffusion_pytorch_model.bin; preheat reads safetensors only "
            "(convert once with diffusers: UNet2DModel.from_pretrained(p).save_pretrained(p))"
        )
    raise ModelNotFoundError(f"{unet_dir} has no {WEIGHTS_NAME}")


def _read_tensors(files: list[Path]) -> dict[str, np.ndarray]:
    """All tensors, as numpy (bf16 via ml_dtypes), with deprecated attention names renamed."""
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="flax") as handle:
                for key in handle.keys():
                    out[key] = np.asarray(handle.get_tensor(key))
        except Exception as exc:  # safetensors raises its own types for torn/corrupt headers
            raise WeightsError(f"cannot read {f}: {exc}") from None
    renamed = {}
    for key, value in out.items():
        parts = key.split(".")
        if len(parts) >= 2 and parts[-2] in _DEPRECATED_ATTENTION:
            key = ".".join(parts[:-2] + [_DEPRECATED_ATTENTION[parts[-2]], parts[-1]])
        elif parts[-1] == "W" and len(parts) >= 2 and parts[-2] == "time_proj":  # old Fourier name
            key = "time_proj.weight"
        renamed[key] = value
    return renamed


def _fill(abstract: nnx.State, tensors: dict[str, np.ndarray], dtype: jnp.dtype, source: str) -> nnx.State:
    flat = nnx.to_flat_state(abstract)
    problems: list[str] = []
    filled: list[tuple[tuple[Any, ...], Any]] = []
    used = set()
    for path, var in flat:
        leaf = str(path[-1])
        key = torch_key(path)
        expected = _expected_torch_shape(tuple(var.shape), leaf)
        arr = tensors.get(key)
        if arr is None:
            problems.append(f"missing {key} (expected shape {expected})")
            continue
        used.add(key)
        if tuple(arr.shape) != expected:
            problems.append(f"{key} has shape {tuple(arr.shape)}, expected {expected}")
            continue
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
            problems.append(f"{key} has dtype {arr.dtype}, expected a floating-point dtype")
            continue
        filled.append((path, var.replace(jnp.asarray(_to_jax_layout(arr, leaf), dtype=dtype))))
    extra = sorted(set(tensors) - used)
    problems.extend(f"unexpected {k} {tuple(tensors[k].shape)}" for k in extra)
    if problems:
        shown = "; ".join(problems[:6]) + (f"; (+{len(problems) - 6} more)" if len(problems) > 6 else "")
        raise WeightsError(f"{source} does not match its config: {shown}")
    return nnx.from_flat_state(filled)


@dataclass
class UNet2D:
    """A loaded UNet: ``unet(sample, timestep, class_labels)`` in NCHW, like diffusers' ``.sample``.

    ``params`` is the weight pytree; ``apply`` is the pure NHWC function the sampler compiles,
    with the weights as an argument so one compiled program serves every fine-tune.
    """

    config: UNet2DConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    dtype: Any = jnp.float32

    def apply(self, params: nnx.State, x: jax.Array, t: jax.Array, class_labels: jax.Array | None = None) -> jax.Array:
        """Pure NHWC forward: (B,H,W,C), (B,) -> (B,H,W,C)."""
        return nnx.merge(self.graphdef, params)(x, t, class_labels)

    def __call__(self, sample: jax.Array, timestep: Any, class_labels: Any = None) -> jax.Array:
        x = jnp.transpose(jnp.asarray(sample, self.dtype), (0, 2, 3, 1))  # NCHW -> NHWC
        t = jnp.broadcast_to(jnp.asarray(timestep, jnp.float32), (x.shape[0],))
        y = None if class_labels is None else jnp.asarray(class_labels)
        if y is not None and y.ndim == 0:
            y = jnp.broadcast_to(y, (x.shape[0],))
        out = self.apply(self.params, x, t, y)
        return jnp.transpose(out, (0, 3, 1, 2))  # NHWC -> NCHW


def load_unet(path: str | Path, dtype: Any = jnp.float32) -> UNet2D:
    """Load a diffusers UNet2DModel folder (or a pipeline folder's ``unet/``) into JAX."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise UnsupportedConfigError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    unet_dir = resolve_unet_dir(path)
    config = read_unet_config(unet_dir)
    graphdef, abstract = build_abstract(config)
    tensors = _read_tensors(_weight_files(unet_dir))
    params = _fill(abstract, tensors, dtype, str(unet_dir))
    return UNet2D(config=config, graphdef=graphdef, params=params, dtype=dtype)


def _to_torch_layout(arr: np.ndarray, leaf: str) -> np.ndarray:
    if leaf == "kernel" and arr.ndim == 4:  # (kH, kW, I, O) -> (O, I, kH, kW)
        return arr.transpose(3, 2, 0, 1)
    if leaf == "kernel" and arr.ndim == 2:
        return arr.T
    return arr


def save_unet(config: UNet2DConfig, params: nnx.State, directory: str | Path, dtype: Any = np.float32) -> Path:
    """Write a diffusers-format UNet folder (config.json + safetensors) that torch diffusers loads."""
    from safetensors.numpy import save_file

    from preheat.cache.atomic import atomic_write_bytes

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        torch_key(path): np.ascontiguousarray(_to_torch_layout(np.asarray(var.get_value(), dtype=dtype), str(path[-1])))
        for path, var in nnx.to_flat_state(params)
    }
    tmp = directory / f".{WEIGHTS_NAME}.tmp"
    save_file(tensors, str(tmp))
    atomic_write_bytes(directory / WEIGHTS_NAME, tmp.read_bytes())
    tmp.unlink()
    raw = {"_class_name": "UNet2DModel", **config.to_dict()}
    atomic_write_bytes(directory / "config.json", (json.dumps(raw, indent=2) + "\n").encode())
    return directory
