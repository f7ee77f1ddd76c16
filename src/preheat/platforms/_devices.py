"""The running machine's devices as the rest of preheat names them: labels, key fields, and the
questions surfaces ask (has it an accelerator, does a compile here autotune), answered per
platform so that no module outside the seam asks which backend it is on."""

from __future__ import annotations

from typing import Any, Optional

import jax

from preheat.platforms._select import get, local

__all__ = ["describe_device", "accelerator_label", "device_fields", "mesh_fields", "key_device_label",
           "key_runtime", "autotunes_here", "devices_of", "host_device", "host_fields"]


def describe_device(device: Any = None) -> dict[str, str]:
    """``{"device": its kind, "platform": its platform}`` of ``device`` (default: the first local one),
    as benchmark rows record it."""
    device = jax.devices()[0] if device is None else device
    return {"device": str(device.device_kind), "platform": str(device.platform)}


def accelerator_label() -> str:
    """"no accelerator" on the CPU, else "<count>x <kind>" of the local devices."""
    if not local().accelerator:
        return "no accelerator"
    return f"{jax.device_count()}x {jax.devices()[0].device_kind}"


def devices_of(platform: str) -> list[Any]:
    """The local devices of ``platform`` (jax's name: "gpu", "tpu", "cpu")."""
    return [d for d in jax.devices() if d.platform == platform]


def device_fields(mesh_size: Optional[int] = None, target: Any = None) -> dict[str, Any]:
    """The cache key's device fields (``preheat.cache.keys``): those of ``target``'s platform for a
    deviceless compile (``target.platform``), else the local devices' platform's, over
    ``mesh_size`` devices (None: a single-device program)."""
    platform = get(target.platform) if target is not None else local()
    return platform.device_fields(jax.devices()[0], mesh_size, target)


def mesh_fields(mesh: Any) -> dict[str, Any]:
    """A mesh's key field: its axes, the ids of its devices in order, and their kinds."""
    return {"axes": {str(k): int(v) for k, v in mesh.shape.items()},
            "devices": [int(d.id) for d in mesh.devices.flat],
            "device_kind": sorted({d.device_kind for d in mesh.devices.flat})}


def key_device_label(fields: dict[str, Any]) -> str:
    """A short name of the device a key's ``fields`` are for (``preheat cache ls``)."""
    gpu = fields.get("gpu")
    if isinstance(gpu, dict):
        return f"sm_{''.join(map(str, gpu.get('compute_capability', [])))} x{gpu.get('core_count', '?')}"
    return str(fields.get("device_kind", ""))


def key_runtime(fields: dict[str, Any]) -> str:
    """The runtime a key's program runs on, as the serialisation guard tells them apart
    (``preheat.cache.compile``): a "gpu" key names CUDA only through its CUDA plugin's version
    (ROCm's devices are "gpu" too); other keys, their platform."""
    platform = str(fields.get("platform"))
    if platform == "gpu" and any(name.startswith("jax-cuda") for name in fields.get("cuda") or {}):
        return "cuda"
    return platform


def autotunes_here() -> bool:
    """Whether a compile in this process autotunes (GPUs, unless ``--xla_gpu_autotune_level=0``)."""
    platform = local()
    return platform.autotunes and platform.autotunes_now()


def host_device() -> Any:
    """The host's CPU device, beside the accelerator's (jax keeps the CPU backend whenever
    ``JAX_PLATFORMS`` leaves it in): where ``preheat.load(encoders_on="host")`` keeps and runs the text
    encoders. A one-line ``InvalidArgumentError`` where this process has no CPU backend."""
    from preheat.errors import InvalidArgumentError

    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        raise InvalidArgumentError("encoders_on='host' needs JAX's CPU backend beside the accelerator; "
                                   "JAX_PLATFORMS leaves it out (add cpu: JAX_PLATFORMS=tpu,cpu)",
                                   argument="encoders_on") from None


OFFLOAD_MEMORY = "pinned_host"  # where offloaded weights wait: host memory the device reads by DMA


def offload_memory(device: Any = None) -> str | None:
    """The memory kind offloaded text encoders' weights are kept in (``preheat.load(offload_encoders=True)``):
    the device's pinned host memory, which its programs read from, so the encode stage moves each
    block's weights in as its scan reaches it (``storage.upcast``) and the device holds one block,
    not the encoder; None where the device has no such memory (the weights are then numpy arrays,
    moved in whole for each call)."""
    device = device or jax.devices()[0]
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except Exception:  # a backend without memory spaces
        return None
    return OFFLOAD_MEMORY if OFFLOAD_MEMORY in kinds else None


def host_fields() -> tuple[tuple[str, Any], ...]:
    """A host stage's part of its signature (and so of its cache key): the program is XLA:CPU's for
    this host's instruction set, whatever the accelerator beside it."""
    from preheat.platforms._cpu import cpu_features, host_dtype_setting

    # the instruction set decides the host's compute dtype too (``host_compute_dtype``), and so does its setting
    return (("runs_on", "cpu"), ("host_cpu", cpu_features()), ("host_dtype", host_dtype_setting()))
