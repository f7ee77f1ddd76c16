"""Low-rank adapters (LoRA) as runtime data of a compiled model, one adapter per image.

A LoRA changes a layer ``y = x W + b`` into ``y + scale * (x A^T) B^T``. Here the factors are
never merged into the weights and never constants: they are arguments of the compiled program,
stacked for K adapter *slots* and padded to a rank bucket R, for every layer of a fixed target
set (each Linear and 1x1 conv of the model; a layer a LoRA does not touch gets zeros). Each image
picks its slot by index, so one batch can mix adapters (a batched low-rank product per image, as
S-LoRA/Punica do for language models)::

    down   (K, in, R)    a slot's A factors, transposed; several LoRAs in one slot sit side by side
    up     (K, R, out)   a slot's B factors, transposed, times alpha / rank
    scales (K, R)        the user's scale of the LoRA that owns each rank column (0 for padding)
    index  (B,)          each image's slot

    delta_b = ((x_b @ down[index_b]) * scales[index_b]) @ up[index_b]     # (B, ..., out)

A new LoRA, a new scale or a new mix is new data of the same shapes: no retrace. ``attach`` hangs
the factors on the layers of a model just merged inside a traced call (``nnx.merge``); with
nothing attached the layers run exactly the program they ran before LoRA support existed. The
engine passes them as a stage argument of their own (``preheat.families.stages.LoraArgs``),
never inside the weights or the conditioning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Adapters", "LowRank", "attach", "targets"]

Array = jax.Array


@dataclass(frozen=True)
class Adapters:
    """K adapter slots for one model and each image's slot (a pytree of arrays, traced)."""

    factors: Mapping[str, tuple[Array, Array]]  # layer path -> (down (K, in, R), up (K, R, out))
    scales: Array  # (K, R)
    index: Array  # (B,) int32

    def attach_stacked(self, block: nnx.Module, factors: Mapping[str, tuple[Array, Array]]) -> None:
        """Inside a ``BlockStack``'s scan: give one block's layers their slice of the stacked factors
        (``factors``: relative layer path -> (down (K, in, R), up (K, R, out))). A method, so that the
        scan applies adapters without importing this module (``stacking`` sits below it)."""
        for path, module in nnx.iter_graph(block):
            pair = factors.get(".".join(str(p) for p in path)) if isinstance(module, nnx.Module) else None
            if pair is not None:
                object.__setattr__(module, "lora", LowRank(pair[0], pair[1], self.scales, self.index))


jax.tree_util.register_dataclass(Adapters, data_fields=["factors", "scales", "index"], meta_fields=[])


class LowRank:
    """One layer's adapters for one call: ``x (B, ..., in) -> delta (B, ..., out)``."""

    def __init__(self, down: Array, up: Array, scales: Array, index: Array):
        self.down, self.up, self.scales, self.index = down, up, scales, index

    def __call__(self, x: Array) -> Array:
        b = x.shape[0]
        if self.index.shape[0] != b:
            raise ValueError(f"LoRA index has {self.index.shape[0]} images, the layer input has {b}")
        h = x.reshape(b, -1, x.shape[-1])  # (B, L, in): tokens, pixels (1x1 conv) or one vector
        down = jnp.take(self.down, self.index, axis=0).astype(x.dtype)  # (B, in, R)
        up = jnp.take(self.up, self.index, axis=0).astype(x.dtype)  # (B, R, out)
        scales = jnp.take(self.scales, self.index, axis=0).astype(x.dtype)  # (B, R)
        r = jnp.einsum("bli,bir->blr", h, down) * scales[:, None, :]  # (B, L, R)
        y = jnp.einsum("blr,bro->blo", r, up)  # (B, L, out)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def attach(model: nnx.Module, adapters: Adapters | None) -> nnx.Module:
    """Give the layers of a freshly merged ``model`` their adapters for this traced call.

    A ``stacking.BlockStack`` (N blocks scanned over layer-stacked weights) gets its blocks'
    factors stacked, ``(N, K, in, R)`` and ``(N, K, R, out)`` per layer of the block, which its
    scan slices per block (``Adapters.attach_stacked``): a few MB, stacked inside the trace."""
    from preheat.models.block_paths import STACKED, block_path
    from preheat.models.stacking import BlockStack

    if adapters is None:
        return model
    for path, module in nnx.iter_graph(model):
        if not isinstance(module, nnx.Module):
            continue
        name = ".".join(str(p) for p in path)
        if isinstance(module, BlockStack):
            stacked = {}
            for rel, _ in nnx.iter_graph(module.stacked):
                sub = ".".join(str(p) for p in rel)
                pairs = [adapters.factors.get(".".join([*block_path(path, i), *([sub] if sub else [])]))
                         for i in range(module.n)]
                if all(p is not None for p in pairs):
                    stacked[sub] = (jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs]))
            if stacked:
                object.__setattr__(module, "lora", Adapters(stacked, adapters.scales, adapters.index))
            continue
        if STACKED in (str(p) for p in path):
            continue
        pair = adapters.factors.get(name)
        if pair is not None:
            # a plain attribute, set on a module that lives for one trace only (never split again)
            object.__setattr__(module, "lora", LowRank(pair[0], pair[1], adapters.scales, adapters.index))
    return model




def targets(graphdef: nnx.GraphDef, params: Any) -> dict[str, tuple[int, int]]:
    """The fixed target set of a model: every ``Linear`` and 1x1 ``Conv2d`` (the layers that take an
    adapter), as ``{layer path: (in, out)}`` -- a path is the checkpoint key without ``.weight``."""
    from preheat.models.layers import Conv2d, Linear
    from preheat.models.block_paths import STACKED, block_path

    out: dict[str, tuple[int, int]] = {}
    for path, module in nnx.iter_graph(nnx.merge(graphdef, params)):
        names = [str(p) for p in path]
        shape = tuple(module.kernel.shape) if isinstance(module, (Linear, Conv2d)) else ()
        stacked = STACKED in names  # a BlockStack's layer: (N, ...) weights, one target per block
        if stacked:
            shape = shape[1:]
        if isinstance(module, Linear) or (isinstance(module, Conv2d) and shape[:2] == (1, 1)
                                          and module.stride == 1 and module.padding == 0):
            if not stacked:
                out[".".join(names)] = (int(shape[-2]), int(shape[-1]))
                continue
            at = names.index(STACKED)
            for i in range(int(module.kernel.shape[0])):
                out[".".join([*block_path(names[:at], i), *names[at + 1:]])] = (int(shape[-2]), int(shape[-1]))
    return out
