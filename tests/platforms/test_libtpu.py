"""libtpu as a TPU key reads it (``preheat.platforms._libtpu``) and the TPU platform's key fields,
from the recorded v5e VM and builder: no libtpu needed (the compiles that check them against libtpu
itself: tests/cache/test_tpu_targets.py)."""

from __future__ import annotations

from types import SimpleNamespace

from preheat import platforms
from tests._support.tpu_fixtures import V5E_BUILDER, V5E_VM, recorded_devices

TPU = platforms.get("tpu")


def test_the_vm_and_a_builder_give_one_chip_s_fields(monkeypatch):
    """The recorded VM's first device (its LIBTPU_INIT_ARGS as jax left it, its TPU_* variables) and
    the builder's compile-only device for v5e:1x1 (no variables) give the same key fields."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the VM had none (the suite sets its own)
    for name, value in V5E_VM["env"].items():
        monkeypatch.setenv(name, value)
    vm = TPU.device_fields(recorded_devices(V5E_VM)[0], None)
    for name in V5E_VM["env"]:
        monkeypatch.delenv(name)
    builder_device = recorded_devices(V5E_BUILDER)[0]
    target = SimpleNamespace(platform="tpu", key_fields=lambda: {
        "device_kind": builder_device.device_kind, "platform_version": builder_device.client.platform_version})
    assert TPU.device_fields(builder_device, None, target) == vm
    assert vm == {"platform": "tpu", "device_kind": "TPU v5 lite", "platform_version": V5E_VM["platform_version"],
                  "device_count": 1, "xla_flags": "", "libtpu_init_args": "--xla_tpu_use_enhanced_launch_barrier=true"}


def test_the_recorded_vm_and_builder_name_one_libtpu_build():
    """The chip's client (libtpu from TPU_LIBRARY_PATH) and a builder's compile-only client with the
    same libtpu (0.0.42.1) say the same words: the key's libtpu build."""
    assert V5E_VM["versions"] == V5E_BUILDER["versions"]
    assert V5E_VM["platform_version"] == V5E_BUILDER["platform_version"]
    assert V5E_VM["platform_version"].endswith("cl/933746096")


def test_libtpu_init_args_read_as_on_a_vm(monkeypatch):
    """jax adds its launch-barrier flag to LIBTPU_INIT_ARGS on a VM with chips only: both paths read it added."""
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    builder = platforms.libtpu_init_args()
    monkeypatch.setenv("LIBTPU_INIT_ARGS", V5E_VM["env"]["LIBTPU_INIT_ARGS"])
    assert platforms.libtpu_init_args() == builder == "--xla_tpu_use_enhanced_launch_barrier=true"
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_use_enhanced_launch_barrier=false")
    assert platforms.libtpu_init_args() == "--xla_tpu_use_enhanced_launch_barrier=false"  # the user's word kept


def test_a_megacore_slice_is_described_by_chips_not_cores():
    """v4/v5p: one device per chip with two cores; the shape is the chips' coordinates' extent."""
    record = {**V5E_BUILDER, "device": {**V5E_BUILDER["device"], "device_kind": "TPU v5", "num_cores": 2}}
    four = [recorded_devices(record)[0] for _ in range(4)]
    for i, d in enumerate(four):
        d.coords = [i % 2, i // 2, 0]
    described = platforms.slice_description(four)
    assert (described["chips"], described["devices"], described["cores_per_device"]) == ([2, 2, 1], 4, 2)
