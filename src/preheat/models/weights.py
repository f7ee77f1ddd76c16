"""Reading diffusers/transformers safetensors into an abstract NNX model, for every model family.

One loader serves every component (UNet, CLIP text encoder, VAE, ...): the module is built
abstractly (``nnx.eval_shape``: shapes only, no FLOPs, no memory), then each parameter leaf is
filled from the checkpoint tensor whose key is the leaf's path, converted from torch layout.
Nothing is returned until every tensor has been checked, so a bad checkpoint never yields a
half-loaded model.

Key convention (the parameter path *is* the checkpoint key, modulo the leaf name)::

    kernel -> weight (transposed: conv OIHW -> HWIO, linear (out, in) -> (in, out))
    scale -> weight, embedding -> weight, bias -> bias, weight -> weight

Weight files a component folder may hold, in the order they are looked for::

    <stem>[.<variant>].safetensors                     one file
    <stem>.safetensors.index[.<variant>].json + shards  sharded (``weight_map``); what diffusers
    <stem>[.<variant>].safetensors.index.json + shards  and transformers write, then the older name

where ``stem`` is ``diffusion_pytorch_model`` (diffusers) or ``model`` (transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preheat.errors import ModelFormatError, ModelNotFoundError, UnsupportedConfigError, WeightsError

__all__ = [
    "DIFFUSERS_STEM",
    "TRANSFORMERS_STEM",
    "weight_files",
    "read_tensors",
    "torch_key",
    "to_jax_layout",
    "to_torch_layout",
    "expected_torch_shape",
    "fill",
    "build_abstract",
    "read_json",
    "check_dtype",
]

DIFFUSERS_STEM = "diffusion_pytorch_model"
TRANSFORMERS_STEM = "model"

_LEAF_TO_TORCH = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias", "weight": "weight"}


def read_json(path: Path, what: str = "config") -> dict[str, Any]:
    """A JSON object from ``path``; a missing file or bad JSON is a one-line error naming it."""
    if not path.is_file():
        raise ModelNotFoundError(f"{path} does not exist ({what})")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        reason = f"{exc.msg} (line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise ModelFormatError(f"{path} is not valid JSON: {reason}") from None
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{path} must hold a JSON object")
    return raw


def weight_files(folder: Path, stems: Sequence[str] = (DIFFUSERS_STEM, TRANSFORMERS_STEM),
                 variant: str | None = None) -> list[Path]:
    """The safetensors file(s) of one component folder (see the module docstring)."""
    tried = []
    for stem in stems:
        base = f"{stem}.{variant}" if variant else stem
        single = folder / f"{base}.safetensors"
        tried.append(single.name)
        if single.is_file():
            return [single]
        # diffusers and transformers name a variant's index <stem>.safetensors.index.<variant>.json
        indexes = [folder / f"{stem}.safetensors.index.{variant}.json"] if variant else []
        indexes.append(folder / f"{base}.safetensors.index.json")
        index = next((i for i in indexes if i.is_file()), None)
        if index is not None:
            weight_map = read_json(index, "shard index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelFormatError(f"{index} has no 'weight_map' object")
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise ModelNotFoundError(f"{folder} is missing shard file(s) {', '.join(missing)} listed in {index.name}")
            return [folder / s for s in shards]
    bins = sorted(p.name for p in folder.glob("*.bin"))
    if bins:
        raise ModelNotFoundError(
            f"{folder} has only {bins[0]}; preheat reads safetensors only "
            "(convert once with diffusers/transformers: from_pretrained(p).save_pretrained(p))")
    hint = f" (variant {variant!r})" if variant else ""
    raise ModelNotFoundError(f"{folder} has no {' or '.join(tried)}{hint}")


def read_tensors(files: Iterable[Path], rename: Callable[[str], str] | None = None) -> dict[str, np.ndarray]:
    """All tensors of ``files`` as numpy (bf16 via ml_dtypes), keys passed through ``rename``."""
    from safetensors import safe_open

    out: dict[str, np.ndarray] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="flax") as handle:
                for key in handle.keys():
                    out[rename(key) if rename else key] = np.asarray(handle.get_tensor(key))
        except Exception as exc:  # safetensors raises its own types for torn/corrupt headers
            raise WeightsError(f"cannot read {f}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return out


def torch_key(path: tuple[Any, ...]) -> str:
    """NNX parameter path -> torch state-dict key."""
    *mods, leaf = (str(p) for p in path)
    return ".".join([*mods, _LEAF_TO_TORCH[leaf]])


def to_jax_layout(arr: np.ndarray, leaf: str) -> np.ndarray:
    if leaf == "kernel" and arr.ndim == 4:  # conv: (O, I, kH, kW) -> (kH, kW, I, O)
        return arr.transpose(2, 3, 1, 0)
    if leaf == "kernel" and arr.ndim == 2:  # linear: (out, in) -> (in, out)
        return arr.T
    return arr


def to_torch_layout(arr: np.ndarray, leaf: str) -> np.ndarray:
    if leaf == "kernel" and arr.ndim == 4:  # (kH, kW, I, O) -> (O, I, kH, kW)
        return arr.transpose(3, 2, 0, 1)
    if leaf == "kernel" and arr.ndim == 2:
        return arr.T
    return arr


def expected_torch_shape(shape: tuple[int, ...], leaf: str) -> tuple[int, ...]:
    if leaf == "kernel" and len(shape) == 4:
        kh, kw, i, o = shape
        return (o, i, kh, kw)
    if leaf == "kernel" and len(shape) == 2:
        return (shape[1], shape[0])
    return tuple(shape)


class OneKey:
    """Stands in for ``nnx.Rngs`` in an abstract build: the same key for every initialiser.

    ``nnx.Rngs`` bumps a counter Variable per draw, and under ``eval_shape`` each bump costs time
    linear in the program traced so far (flax's sharding check on a tracer): quadratic in the
    tensor count, about a minute for SDXL's UNet. Values are never computed here, and preheat's
    models draw only ``rngs.params()`` (no dropout streams).
    """

    def __init__(self) -> None:
        self.key = jax.random.key(0)

    def params(self) -> jax.Array:
        return self.key


def build_abstract(make: Callable[[Any], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and a State of ShapeDtypeStructs of ``make(rngs)``; no FLOPs, no memory."""
    abstract = nnx.eval_shape(lambda: make(OneKey()))
    return nnx.split(abstract)


def fill(abstract: nnx.State, tensors: dict[str, np.ndarray], dtype: Any, source: str, *,
         key_fn: Callable[[tuple[Any, ...]], str] = torch_key,
         ignore: Callable[[str], bool] | None = None,
         dtype_for: Callable[[str], Any] | None = None) -> nnx.State:
    """Fill ``abstract`` from ``tensors``; every problem is listed in one ``WeightsError``.

    ``ignore(key)``: checkpoint keys that may be present without a parameter (e.g. buffers such
    as transformers' ``position_ids``). ``dtype_for(key)``: a per-tensor dtype override.
    """
    flat = nnx.to_flat_state(abstract)
    problems: list[str] = []
    filled: list[tuple[tuple[Any, ...], Any]] = []
    used = set()
    for path, var in flat:
        leaf = str(path[-1])
        key = key_fn(path)
        expected = expected_torch_shape(tuple(var.shape), leaf)
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
        want = dtype_for(key) if dtype_for is not None else dtype
        filled.append((path, var.replace(jnp.asarray(to_jax_layout(arr, leaf), dtype=want))))
    extra = sorted(k for k in set(tensors) - used if not (ignore and ignore(k)))
    problems.extend(f"unexpected {k} {tuple(tensors[k].shape)}" for k in extra)
    if problems:
        shown = "; ".join(problems[:6]) + (f"; (+{len(problems) - 6} more)" if len(problems) > 6 else "")
        raise WeightsError(f"{source} does not match its config: {shown}")
    return nnx.from_flat_state(filled)


def check_dtype(dtype: Any) -> jnp.dtype:
    """A floating dtype for weights/activations, or a one-line error."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise UnsupportedConfigError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16") from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise UnsupportedConfigError(f"unsupported dtype {dt}; use float32, bfloat16 or float16")
    return dt

