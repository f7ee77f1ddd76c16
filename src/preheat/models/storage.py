"""fp8 weight storage: which layers of a denoiser are kept in fp8, and their upcast at use.

    preheat.load(model, weights_dtype="float8_e4m3fn")

The layers are the ones diffusers' ``enable_layerwise_casting(storage_dtype=float8_e4m3fn)``
casts, so a model stored here matches diffusers' own fp8 storage: every Linear, Conv and
Embedding weight, unless a module on its path matches one of the skip patterns (``re.search``
on each dotted prefix of the module's name, as diffusers walks ``named_children``):

    DEFAULT_SKIP   pos_embed, patch_embed, norm, ^proj_in$, ^proj_out$   (every model)
    + the model's own ``_skip_layerwise_casting_patterns`` (``extra``)

``^proj_in$`` and ``^proj_out$`` are anchored, so only the top-level projections stay at full
precision; an attention block's inner ``proj_in``/``proj_out`` is cast. Biases stay in the
compute dtype (diffusers casts them too; they are a rounding error of the bytes).

The weights are placed in fp8 by ``weights.fill`` (``LoadOptions.weights_dtype`` with ``low``)
and stay so on the device; the model's ``apply`` calls ``upcast`` inside the jitted program, so
each weight is converted to the compute dtype where it is used. A tensor already stored as
``F8_E4M3`` is placed as it is (no cast on the host).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FLOAT8", "WEIGHTS_DTYPES", "DEFAULT_SKIP", "layerwise", "upcast", "is_low"]

FLOAT8 = "float8_e4m3fn"
WEIGHTS_DTYPES = (FLOAT8,)  # what weights_dtype= takes
DEFAULT_SKIP = ("pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$")  # diffusers' DEFAULT_SKIP_MODULES_PATTERN
_LOW = (jnp.dtype(jnp.float8_e4m3fn),)


def layerwise(extra: Sequence[str] = ()) -> Callable[[str], bool]:
    """``low(key)`` for ``weights.fill``: True for a weight (torch key ``<module>.weight``) whose
    module no skip pattern matches on any prefix of its dotted name. ``fill`` asks only about the
    weights of Linear, Conv and Embedding layers (its ``kernel`` and ``embedding`` leaves)."""
    patterns = [re.compile(p) for p in dict.fromkeys((*DEFAULT_SKIP, *extra))]

    def low(key: str) -> bool:
        module, _, leaf = key.rpartition(".")
        if leaf != "weight" or not module:
            return False
        parts = module.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return not any(p.search(prefix) for prefix in prefixes for p in patterns)

    return low


def is_low(dtype: Any) -> bool:
    """Whether ``dtype`` is a storage dtype that ``upcast`` converts."""
    return np.dtype(dtype) in _LOW


def upcast(params: Any, dtype: Any) -> Any:
    """``params`` with every fp8 leaf converted to ``dtype`` (the compute dtype); the rest as they
    are. Called inside the jitted apply, so the device keeps fp8 and XLA places the converts."""
    return jax.tree.map(lambda x: x.astype(dtype) if is_low(x.dtype) else x, params)
