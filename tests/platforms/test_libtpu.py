"""A TPU slice's key fields (``preheat.platforms._libtpu``), from the recorded v5e VM and builder:
no libtpu needed (the compiles that check them against libtpu itself: tests/cache/test_tpu_targets.py)."""

from __future__ import annotations

from preheat import platforms
from tests._support.tpu_fixtures import V5E_BUILDER, V5E_VM, recorded_devices


def test_the_vm_and_a_builder_give_one_slice_s_fields(monkeypatch):
    """The recorded VM's devices (its LIBTPU_INIT_ARGS as jax left it, its TPU_* variables) and the
    builder's compile-only device for v5e:1x1 (no variables) give the same fields."""
    for name, value in V5E_VM["env"].items():
        monkeypatch.setenv(name, value)
    vm = platforms.tpu_fields(recorded_devices(V5E_VM))
    for name in V5E_VM["env"]:
        monkeypatch.delenv(name)
    builder = platforms.tpu_fields(recorded_devices(V5E_BUILDER))
    assert vm == builder
    assert vm["device_kind"] == "TPU v5 lite"
    assert {k: v for k, v in vm["tpu"].items() if k != "libtpu"} == {
        "cores_per_device": 1, "chips": [1, 1, 1], "devices": 1,
        "libtpu_build": "Built on Jun 17 2026 11:08:48 (1781719728) cl/933746096",
        "libtpu_init_args": "--xla_tpu_use_enhanced_launch_barrier=true"}


def test_the_recorded_vm_and_builder_name_one_libtpu_build():
    """The key reads libtpu's build from the client's words: the chip's and a builder's compile-only
    client with the same libtpu (0.0.42.1) say the same (the VM loads libtpu from TPU_LIBRARY_PATH)."""
    assert V5E_VM["versions"] == V5E_BUILDER["versions"]
    assert platforms.libtpu_build(V5E_VM["platform_version"]) == platforms.libtpu_build(V5E_BUILDER["platform_version"])
    assert platforms.libtpu_build("PJRT C API\nTFRT TPU v6 lite") == "PJRT C API TFRT TPU v6 lite"  # no build line


def test_libtpu_init_args_read_as_on_a_vm(monkeypatch):
    """jax adds its launch-barrier flag to LIBTPU_INIT_ARGS on a VM with chips only: both paths read it added."""
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    builder = platforms.libtpu_init_args()
    monkeypatch.setenv("LIBTPU_INIT_ARGS", V5E_VM["env"]["LIBTPU_INIT_ARGS"])
    assert platforms.libtpu_init_args() == builder == "--xla_tpu_use_enhanced_launch_barrier=true"
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_use_enhanced_launch_barrier=false")
    assert platforms.libtpu_init_args() == "--xla_tpu_use_enhanced_launch_barrier=false"  # the user's word kept


def test_a_megacore_slice_counts_chips_not_cores():
    """v4/v5p: one device per chip with two cores; the shape is the chips' coordinates' extent."""
    record = {**V5E_BUILDER, "device": {**V5E_BUILDER["device"], "device_kind": "TPU v5", "num_cores": 2}}
    four = [recorded_devices(record)[0] for _ in range(4)]
    for i, d in enumerate(four):
        d.coords = [i % 2, i // 2, 0]
    fields = platforms.tpu_fields(four)["tpu"]
    assert fields["chips"] == [2, 2, 1] and fields["devices"] == 4 and fields["cores_per_device"] == 2
