"""Data parallelism over the local devices: one program, the batch split over a mesh axis ``data``.

    devices="all" | N | [ids]   ->   Mesh(devices, ("data",)), or None for the first device alone

With a mesh, every stage's program (encode, denoise, decode) is wrapped in ``shard_map``: each
device runs the single-device program on its slice of the batch -- seeds, the user's noise,
conditioning, token ids, latents -- while the weights and the schedule are replicated. Every
stage is per image (seeds, group norms and attention never mix images), so no device talks to
another, and classifier-free guidance doubles each device's own slice. ``None`` (one device,
the default device) keeps the single-device program and cache key exactly as they were.

A batch that does not split evenly is padded to the next multiple of the device count by
repeating its last image, and the padding is dropped from the outputs: on a pod those rows run
on devices that would otherwise idle, so ``pipe("a fox")`` takes the same time on 8 GPUs as on
one, and the default (all devices) accepts every ``n``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from preheat.errors import InvalidArgumentError

__all__ = ["AXIS", "select_devices", "parse_devices", "replicate", "replicate_components", "batch_specs", "padded", "pad_batch",
           "place", "shard_program"]

AXIS = "data"
Specs = Any  # a pytree of PartitionSpec shaped like a program's arguments


def select_devices(devices: Any = None) -> Mesh | None:
    """``"all"`` (the default: ``$PREHEAT_DEVICES`` or all), ``N`` (the first N) or a list of
    device ids of the default backend's local devices -> a 1-D ``data`` mesh, or None when the
    choice is the first device alone (today's single-device program)."""
    if devices is None:
        devices = parse_devices(os.environ.get("PREHEAT_DEVICES") or "all", "PREHEAT_DEVICES")
    local = jax.local_devices()
    if isinstance(devices, str):
        if devices != "all":
            raise InvalidArgumentError(f"devices={devices!r} is not supported; use 'all', a count or a list of "
                                       "device ids", argument="devices")
        chosen = list(local)
    elif isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        if not 1 <= int(devices) <= len(local):
            raise InvalidArgumentError(f"devices={int(devices)} must be in [1, {len(local)}] (this host has "
                                       f"{len(local)} {local[0].platform} device(s))", argument="devices")
        chosen = list(local[:int(devices)])
    elif isinstance(devices, (list, tuple)) and devices:
        by_id = {d.id: d for d in local}
        if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in devices):
            raise InvalidArgumentError(f"devices={list(devices)!r} must be device ids (ints)", argument="devices")
        unknown = [int(i) for i in devices if int(i) not in by_id]
        if unknown:
            raise InvalidArgumentError(f"devices: no local device with id {unknown[0]}; ids here: "
                                       f"{sorted(by_id)}", argument="devices")
        if len(set(int(i) for i in devices)) != len(devices):
            raise InvalidArgumentError(f"devices={list(devices)!r} names a device twice", argument="devices")
        chosen = [by_id[int(i)] for i in devices]
    else:
        raise InvalidArgumentError(f"devices={devices!r} must be 'all', a positive int or a non-empty list of "
                                   "device ids", argument="devices")
    if chosen == [local[0]]:
        return None
    return Mesh(np.array(chosen), (AXIS,))


def parse_devices(text: str | None, name: str = "devices") -> Any:
    """A command line's devices: "all", a count ("4") or comma-separated device ids ("0,2")."""
    if text is None or text.strip() == "all":
        return None if text is None else "all"
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise InvalidArgumentError(f"{name} {text!r} must be 'all', a count or comma-separated device ids",
                                   argument="devices")
    return int(parts[0]) if len(parts) == 1 else [int(p) for p in parts]


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Every device-resident leaf replicated over the mesh; host arrays (offloaded encoders'
    weights) stay on the host and travel only when their stage runs."""
    everywhere = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.device_put(x, everywhere) if isinstance(x, jax.Array) else x, tree)


def replicate_components(components: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """A family's components with the weights of each model in it (``.params``) replicated."""
    def one(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, "params"):
            return dataclasses.replace(value, params=replicate(value.params, mesh))
        if isinstance(value, (list, tuple)) and any(hasattr(v, "params") for v in value):
            return type(value)(one(v) for v in value)
        return value

    return {name: one(value) for name, value in components.items()}


def batch_specs(args: tuple, batched: Sequence[int]) -> Specs:
    """``P("data")`` for every array leaf of the argument positions in ``batched`` (batch on axis
    0), ``P()`` (replicated) for everything else and for scalars."""
    def specs(position: int, arg: Any) -> Any:
        split = position in batched
        return jax.tree.map(lambda x: PartitionSpec(AXIS) if split and np.ndim(x) >= 1 else PartitionSpec(), arg)

    return tuple(specs(i, a) for i, a in enumerate(args))


def padded(n: int, mesh: Mesh) -> int:
    """The batch a mesh runs for ``n`` images: the next multiple of its device count."""
    return -(-n // mesh.size) * mesh.size


def pad_batch(args: tuple, specs: Specs, n: int, to: int) -> tuple:
    """Batched leaves of ``n`` rows grown to ``to`` by repeating the last row (dropped later)."""
    if to == n:
        return args

    def pad(x: Any, spec: PartitionSpec) -> Any:
        if spec == PartitionSpec():
            return x
        x = np.asarray(x)
        if x.shape[0] != n:
            raise ValueError(f"a batched argument has {x.shape[0]} rows, the stage's batch is {n}")
        return np.concatenate([x, np.repeat(x[-1:], to - n, axis=0)])

    return jax.tree.map(pad, args, specs)


def place(args: tuple, specs: Specs, mesh: Mesh) -> tuple:
    """Arguments on the mesh: batched leaves split over ``data``, the rest replicated (already
    placed arrays, like the replicated weights, are not copied again)."""
    return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), args, specs)


def shard_program(program: Callable[..., Any], mesh: Mesh, specs: Specs, outputs: int = 1) -> Callable[..., Any]:
    """``program`` run by every device on its slice of the batch (``shard_map``); its outputs
    (one array, or a k-tuple) are batched on axis 0."""
    out_specs = PartitionSpec(AXIS) if outputs == 1 else tuple(PartitionSpec(AXIS) for _ in range(outputs))
    return jax.shard_map(program, mesh=mesh, in_specs=specs, out_specs=out_specs)
