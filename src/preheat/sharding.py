"""Data parallelism over the local devices: one program, the batch split over a mesh axis ``data``.

    devices="all" | N | [ids]   ->   Mesh(devices, ("data",)), or None for the first device alone

With a mesh, every stage's program (encode, denoise, decode) is wrapped in ``shard_map``: each
device runs the single-device program on its slice of the batch -- seeds, the user's noise,
conditioning, token ids, latents: the fields each stage's argument names in its ``BATCHED``
(``preheat.families.stages``) -- while the weights and the schedule are replicated. Every
stage is per image (seeds, group norms and attention never mix images), so no device talks to
another, and classifier-free guidance doubles each device's own slice. ``None`` (one device,
the default device) keeps the single-device program and cache key exactly as they were.

A batch that does not split evenly is padded to the next multiple of the device count by
repeating its last image, and the padding is dropped from the outputs: on a pod those rows run
on devices that would otherwise idle, so ``pipe("a fox")`` takes the same time on 8 GPUs as on
one, and the default (all devices) accepts every ``n``.

Weights that do not fit one device: ``fsdp=F`` makes the mesh two-dimensional,

    Mesh(devices.reshape(N // F, F), ("data", "fsdp"))

Each weight is split over ``fsdp`` on its largest dimension that F divides (small weights, under
``FSDP_MIN_SIZE`` elements, stay whole), the batch is split over both axes, and the programs are
plain ``jit`` programs that XLA's SPMD partitioner splits: it gathers each weight where an
operation uses it and frees the gathered copy after, so a device holds about 1/F of the weights
at rest. Sums over a split weight may be added in another order than on one device, so images
agree with the single-device ones to float rounding, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from preheat.errors import InvalidArgumentError

__all__ = ["AXIS", "FSDP_AXIS", "FSDP_MIN_SIZE", "select_devices", "parse_devices", "is_fsdp", "weight_spec",
           "distribute", "distribute_components", "batch_specs", "padded", "pad_batch", "place", "shard_program"]

AXIS = "data"
FSDP_AXIS = "fsdp"
FSDP_MIN_SIZE = 2**14  # elements: smaller weights (norms, biases) are cheaper to keep whole than to gather
Specs = Any  # a pytree of PartitionSpec shaped like a program's arguments


def select_devices(devices: Any = None, fsdp: int = 1) -> Mesh | None:
    """``"all"`` (the default: ``$PREHEAT_DEVICES`` or all), ``N`` (the first N) or a list of
    device ids of the default backend's local devices -> a 1-D ``data`` mesh, or None when the
    choice is the first device alone (today's single-device program). ``fsdp=F`` (> 1): a
    ``(data, fsdp)`` mesh whose weights are split over F devices; F must divide the count."""
    if isinstance(fsdp, bool) or not isinstance(fsdp, (int, np.integer)) or fsdp < 1:
        raise InvalidArgumentError(f"fsdp={fsdp!r} must be a positive int (the devices each weight is split "
                                   "over; 1: whole weights on every device)", argument="fsdp")
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
    if fsdp > 1:
        if len(chosen) % fsdp:
            raise InvalidArgumentError(f"fsdp={int(fsdp)} must divide the device count ({len(chosen)} "
                                       f"{local[0].platform} device(s) chosen)", argument="fsdp")
        return Mesh(np.array(chosen).reshape(len(chosen) // int(fsdp), int(fsdp)), (AXIS, FSDP_AXIS))
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


def is_fsdp(mesh: Mesh | None) -> bool:
    """Whether ``mesh`` splits the weights (an ``fsdp`` axis) rather than replicating them."""
    return mesh is not None and FSDP_AXIS in mesh.axis_names


def weight_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """Where a weight of ``shape`` lives on ``mesh``: whole on every device (``P()``) on a data
    mesh; on an fsdp mesh split over ``fsdp`` on its largest dimension the axis divides (ties: the
    first), or whole when it is small or no dimension divides."""
    if not is_fsdp(mesh) or math.prod(shape) < FSDP_MIN_SIZE:
        return PartitionSpec()
    parts = mesh.shape[FSDP_AXIS]
    for dim in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
        if shape[dim] % parts == 0:
            return PartitionSpec(*[FSDP_AXIS if d == dim else None for d in range(len(shape))])
    return PartitionSpec()


def distribute(tree: Any, mesh: Mesh) -> Any:
    """Every device-resident leaf put where ``mesh`` keeps weights (:func:`weight_spec`): replicated,
    or split over ``fsdp``; a leaf in the devices' host memory (offloaded encoders' weights:
    ``families.text.offload``) the same in that memory, so their stage still streams them. Numpy
    arrays stay on the host and travel only when their stage runs. Placeholders
    (``jax.ShapeDtypeStruct``: weights not read yet, see ``preheat.load(prefetch=...)``) get the
    placement the weights will have."""
    def put(x: Any) -> Any:
        if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            return x
        kind = getattr(x.sharding, "memory_kind", None) if x.sharding is not None else None
        sharding = NamedSharding(mesh, weight_spec(x.shape, mesh), memory_kind=kind)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.device_put(x, sharding)

    return jax.tree.map(put, tree)


def distribute_components(components: Any, mesh: Mesh) -> Any:
    """A family's components (a frozen dataclass, ``preheat.families.components``) with the weights
    of each model in it (``.params``) distributed: a new object (``dataclasses.replace``)."""
    def one(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, "params"):
            return dataclasses.replace(value, params=distribute(value.params, mesh))
        if isinstance(value, (list, tuple)) and any(hasattr(v, "params") for v in value):
            return type(value)(one(v) for v in value)
        return value

    return dataclasses.replace(components, **{f.name: one(getattr(components, f.name))
                                              for f in dataclasses.fields(components) if f.init})


def batch_specs(args: Any, mesh: Mesh) -> Specs:
    """A stage's arguments (``preheat.families.stages``: a NamedTuple whose ``BATCHED`` names
    its fields batched on axis 0) -> a PartitionSpec per leaf: the batch split over every axis of
    ``mesh`` (``P("data")``, or ``P(("data", "fsdp"))``) for the array leaves of a batched field;
    ``P()`` (replicated, or kept as placed) for everything else and for scalars. A field that is
    itself such a NamedTuple (a LoRA's factors and slots) is split by its own ``BATCHED``."""
    split_spec = PartitionSpec(AXIS) if not is_fsdp(mesh) else PartitionSpec((AXIS, FSDP_AXIS))

    def declares(node: Any) -> bool:
        return isinstance(node, tuple) and hasattr(node, "_fields") and hasattr(type(node), "BATCHED")

    def specs(tree: Any, split: bool) -> Any:
        if split:
            return jax.tree.map(lambda x: split_spec if np.ndim(x) >= 1 else PartitionSpec(), tree)
        return jax.tree.map(lambda node: named(node) if declares(node) else PartitionSpec(), tree, is_leaf=declares)

    def named(node: Any) -> Any:
        return type(node)(**{f: specs(getattr(node, f), f in type(node).BATCHED) for f in node._fields})

    return specs(args, False)


def padded(n: int, mesh: Mesh) -> int:
    """The batch a mesh runs for ``n`` images: the next multiple of its device count."""
    return -(-n // mesh.size) * mesh.size


def pad_batch(args: Any, specs: Specs, n: int, to: int) -> Any:
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


def place(args: Any, specs: Specs, mesh: Mesh) -> Any:
    """Arguments on the mesh: batched leaves split over the batch axes, the rest replicated --
    except arrays already on this mesh (the distributed weights, or their placeholders), which
    keep their placement and are not copied again."""
    def put(x: Any, spec: PartitionSpec) -> Any:
        if spec == PartitionSpec() and isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) \
                and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh:
            return x
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(put, args, specs)


def shard_program(program: Callable[..., Any], mesh: Mesh, specs: Specs, outputs: int = 1) -> Callable[..., Any]:
    """``program`` (of one argument, a stage's NamedTuple; ``specs``: :func:`batch_specs` of it) as
    ``mesh`` runs it. Data parallel: every device runs it on its slice of the batch
    (``shard_map``), its outputs (one array, or a k-tuple) batched on axis 0. fsdp: the program
    itself, for XLA's SPMD partitioner to split by its arguments' placements."""
    if is_fsdp(mesh):
        return program
    out_specs = PartitionSpec(AXIS) if outputs == 1 else tuple(PartitionSpec(AXIS) for _ in range(outputs))
    return jax.shard_map(program, mesh=mesh, in_specs=(specs,), out_specs=out_specs)
