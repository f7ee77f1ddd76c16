"""The running machine's devices as preheat names them, and the key's device fields (the same
fields the keys had before the platform seam: compared against XLA's own description in
tests/cache/test_targets.py for GPUs)."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from preheat import platforms


def test_the_cpu_is_no_accelerator_and_keys_its_instruction_set():
    assert platforms.accelerator_label() == "no accelerator"
    assert platforms.describe_device() == {"device": "cpu", "platform": "cpu"}
    fields = platforms.device_fields()
    assert set(fields) == {"platform", "device_kind", "device_count", "platform_version", "xla_flags", "host_cpu"}
    assert fields["platform"] == "cpu" and fields["host_cpu"] == platforms.cpu_features()
    assert fields["device_count"] == jax.device_count() and fields["xla_flags"] == os.environ.get("XLA_FLAGS", "")
    assert platforms.devices_of("cpu") == jax.devices() and platforms.devices_of("tpu") == []


def test_a_target_keys_through_its_platform():
    """A deviceless target names its platform; the GPU's key holds its description's fields and
    leaves out the flags only XLA:CPU reads (a builder's fake device count)."""

    class GpuTarget:
        platform = "gpu"
        gpu = {"compute_capability": [9, 0], "core_count": 132}

    fields = platforms.device_fields(2, GpuTarget())
    assert fields["platform"] == "gpu" and fields["gpu"] == GpuTarget.gpu and fields["device_count"] == 2
    assert "--xla_force_host_platform_device_count" not in fields["xla_flags"]
    assert fields["cuda"] == platforms.cuda_versions()

    class TpuTarget:  # the hook a deviceless TPU target fills: its own key fields
        platform = "tpu"

        def key_fields(self):
            return {"device_kind": "TPU v5 lite", "topology": "1x1"}

    fields = platforms.device_fields(None, TpuTarget())
    assert fields["platform"] == "tpu" and fields["device_kind"] == "TPU v5 lite" and fields["device_count"] == 1
    assert set(fields) == {"platform", "device_kind", "topology", "device_count", "xla_flags", "libtpu_init_args"}


def test_a_mesh_keys_its_axes_devices_and_kinds():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    assert platforms.mesh_fields(mesh) == {"axes": {"data": 2}, "devices": [0, 1], "device_kind": ["cpu"]}


@pytest.mark.parametrize("fields, label, runtime", [
    ({"platform": "cpu", "device_kind": "cpu"}, "cpu", "cpu"),
    ({"platform": "tpu", "device_kind": "TPU v5 lite"}, "TPU v5 lite", "tpu"),
    ({"platform": "gpu", "gpu": {"compute_capability": [9, 0], "core_count": 132}, "cuda": {"jax-cuda13-plugin": "x"}},
     "sm_90 x132", "cuda"),
    ({"platform": "gpu", "gpu": {"compute_capability": [9, 4], "core_count": 304}, "cuda": {}}, "sm_94 x304", "gpu"),
])
def test_a_key_names_its_device_and_runtime(fields, label, runtime):
    assert platforms.key_device_label(fields) == label and platforms.key_runtime(fields) == runtime


def test_only_a_gpu_autotunes(monkeypatch):
    assert not platforms.autotunes_here()  # the CPU
    gpu = platforms.get("gpu")
    assert gpu.autotunes and gpu.autotunes_now()
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    assert not gpu.autotunes_now()
    assert not platforms.get("tpu").autotunes and not platforms.get("cpu").autotunes
    with platforms.selected(platforms.FakePlatform(autotunes=True)):
        assert platforms.autotunes_here()
