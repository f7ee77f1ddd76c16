"""A recorded TPU v5e VM, for tests that compute a TPU process's cache key without the chip.

``V5E_VM``: what the lent TPU machine reported on 2026-12-06 (the session's probe of the chip:
jax 0.10.2, libtpu 0.0.42.1, one v5e chip of a v5litepod-4 shown to the process), copied field by
field: its first device's attributes, its client's ``platform_version``, and the environment jax's
TPU start leaves (``LIBTPU_INIT_ARGS`` with jax's launch-barrier default). ``V5E_BUILDER``: what a
CPU-only builder with the same libtpu reported for ``v5e:1x1``'s compile-only device (this
machine, ``scripts/tpu_prepare.sh``'s venv). ``tpu_vm`` makes this process look like the VM to
``preheat.platforms``: ``jax.devices()`` returns recorded devices.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

V5E_VM: dict[str, Any] = {
    "versions": {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1"},
    # TpuDevice(id=0, process_index=0, coords=(0,0,0), core_on_chip=0)
    "device": {"platform": "tpu", "device_kind": "TPU v5 lite", "id": 0, "process_index": 0, "host_id": 0,
               "task_id": 0, "local_hardware_id": 0, "coords": (0, 0, 0), "core_on_chip": 0},
    "device_count": 1,
    "platform_version": "PJRT C API\nTFRT TPU v5 lite\nBuilt on Jun 17 2026 11:08:48 (1781719728) cl/933746096",
    # the VM's environment: variables a builder lacks (the key must not read them) and LIBTPU_INIT_ARGS
    "env": {"TPU_TOPOLOGY": "2x2", "TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
            "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "localhost",
            "TPU_SKIP_MDS_QUERY": "true", "LIBTPU_INIT_ARGS": " --xla_tpu_use_enhanced_launch_barrier=true"},
}
V5E_BUILDER: dict[str, Any] = {
    "versions": {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1"},
    "device": {"platform": "tpu", "device_kind": "TPU v5 lite", "id": 0, "coords": [0, 0, 0], "core_on_chip": 0,
               "num_cores": 1},
    "platform_version": "PJRT C API\nTFRT TPU v5 lite\nBuilt on Jun 17 2026 11:08:48 (1781719728) cl/933746096",
    "env": {"LIBTPU_INIT_ARGS": ""},  # jax's TPU start returns before setting anything: no chip
}


def recorded_devices(record: dict[str, Any], platform_version: str | None = None) -> list[Any]:
    """The VM's devices as recorded (``platform_version``: another libtpu's, where the test's libtpu
    is not the recorded one)."""
    client = SimpleNamespace(platform="tpu", platform_version=platform_version or record["platform_version"])
    return [SimpleNamespace(**record["device"], client=client) for _ in range(record.get("device_count", 1))]


def tpu_vm(monkeypatch: Any, record: dict[str, Any] = V5E_VM, platform_version: str | None = None) -> list[Any]:
    """This process as the recorded VM: its devices, and the environment its jax left."""
    import jax

    devices = recorded_devices(record, platform_version)
    monkeypatch.setattr(jax, "devices", lambda *a, **k: list(devices))
    for name, value in record["env"].items():
        monkeypatch.setenv(name, value)
    return devices
