"""Load diffusers-format UNet2DModel folders into JAX, without torch and without random init.

The module is built abstractly (``weights.build_abstract``: shapes only, no initialiser runs), every
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

from preheat.models import weights
from preheat.models.folders import resolve_unet_dir
from preheat.models.storage import layerwise, upcast
from preheat.models.unet2d import UNet2DConfig, UNet2DModule
from preheat.models.safetensors_files import DIFFUSERS_STEM, read_json, read_tensors, weight_files
from preheat.models.weights import check_dtype, fill, to_torch_layout, torch_key

__all__ = ["LoadedUNet2D", "load_unet", "save_unet", "save_weights", "save_component", "resolve_unet_dir", "read_unet_config", "build_abstract", "torch_key"]

WEIGHTS_NAME = f"{DIFFUSERS_STEM}.safetensors"

# Old diffusers attention names, still found in published checkpoints (e.g. google/ddpm-*).
_DEPRECATED_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def read_unet_config(unet_dir: Path) -> UNet2DConfig:
    path = unet_dir / "config.json"
    return UNet2DConfig.from_dict(read_json(path), str(path))


def build_abstract(config: UNet2DConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and a State of ShapeDtypeStructs; costs no FLOPs and no memory."""
    return weights.build_abstract(lambda rngs: UNet2DModule(config, rngs=rngs))


def legacy_unet_key(key: str) -> str:
    """Deprecated attention names (``query``/``key``/...) and the old Fourier name -> today's."""
    parts = key.split(".")
    if len(parts) >= 2 and parts[-2] in _DEPRECATED_ATTENTION:
        return ".".join(parts[:-2] + [_DEPRECATED_ATTENTION[parts[-2]], parts[-1]])
    if parts[-1] == "W" and len(parts) >= 2 and parts[-2] == "time_proj":
        return "time_proj.weight"
    return key


@dataclass
class LoadedUNet2D:
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
        return nnx.merge(self.graphdef, upcast(params, self.dtype, tie=x))(x, t, class_labels)  # fp8-stored weights upcast

    def __call__(self, sample: jax.Array, timestep: Any, class_labels: Any = None) -> jax.Array:
        x = jnp.transpose(jnp.asarray(sample, self.dtype), (0, 2, 3, 1))  # NCHW -> NHWC
        t = jnp.broadcast_to(jnp.asarray(timestep, jnp.float32), (x.shape[0],))
        y = None if class_labels is None else jnp.asarray(class_labels)
        if y is not None and y.ndim == 0:
            y = jnp.broadcast_to(y, (x.shape[0],))
        out = self.apply(self.params, x, t, y)
        return jnp.transpose(out, (0, 3, 1, 2))  # NHWC -> NCHW


def load_unet(path: str | Path, dtype: Any = jnp.float32, variant: str | None = None,
              options: weights.LoadOptions | None = None) -> LoadedUNet2D:
    """Load a diffusers UNet2DModel folder (or a pipeline folder's ``unet/``) into JAX.
    ``variant``: read ``diffusion_pytorch_model.<variant>.safetensors`` (e.g. "fp16")."""
    dtype = check_dtype(dtype)
    unet_dir = resolve_unet_dir(path)
    config = read_unet_config(unet_dir)
    graphdef, abstract = build_abstract(config)
    tensors = read_tensors(weight_files(unet_dir, (DIFFUSERS_STEM,), variant), rename=legacy_unet_key)
    params = fill(abstract, tensors, dtype, str(unet_dir), options=options, low=layerwise(("norm",), options))
    return LoadedUNet2D(config=config, graphdef=graphdef, params=params, dtype=dtype)


def save_weights(params: nnx.State, path: str | Path, dtype: Any = np.float32) -> Path:
    """One safetensors file of ``params`` under torch's key names and layouts (the checkpoint
    diffusers or transformers reads for the module these parameter paths mirror)."""
    from safetensors.numpy import save_file

    from preheat.files import atomic_write_bytes

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        torch_key(key): np.ascontiguousarray(to_torch_layout(np.asarray(var.get_value(), dtype=dtype), str(key[-1])))
        for key, var in nnx.to_flat_state(params)
    }
    tmp = path.parent / f".{path.name}.tmp"
    save_file(tensors, str(tmp))
    atomic_write_bytes(path, tmp.read_bytes())
    tmp.unlink()
    return path


def save_component(params: nnx.State, directory: str | Path, config: dict[str, Any], *,
                   weights_name: str = WEIGHTS_NAME, dtype: Any = np.float32) -> Path:
    """A component folder: ``config.json`` (``config`` as given) + the weights file."""
    from preheat.files import atomic_write_bytes

    directory = Path(directory)
    save_weights(params, directory / weights_name, dtype)
    atomic_write_bytes(directory / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    return directory


def save_unet(config: UNet2DConfig, params: nnx.State, directory: str | Path, dtype: Any = np.float32) -> Path:
    """Write a diffusers-format UNet folder (config.json + safetensors) that torch diffusers loads."""
    return save_component(params, directory, {"_class_name": "UNet2DModel", **config.to_dict()}, dtype=dtype)
