"""Recorded facts of the project's TPU v5e machine (one v5e chip of a v5litepod-4 shown to the
process, jax/jaxlib 0.10.2, libtpu 0.0.42.1; the session probe of 2026-12-06), for tests that
play that machine without the chip.

For `preheat doctor` (tests/doctor):

    JAX_TPU     the JAX probe's JSON there (``python -m preheat.doctor.jax_probe``)
    HOST        what the host shows without JAX: PCI ids, device nodes, TPU_* env, hugepages
    VERSIONS    the installed distributions doctor reads

For the cache key (tests/cache, tests/platforms): ``V5E_VM``, what the chip's process reported,
copied field by field: its first device's attributes, its client's ``platform_version``, and the environment jax's
TPU start leaves (``LIBTPU_INIT_ARGS`` with jax's launch-barrier default). ``V5E_BUILDER``: what a
CPU-only builder with the same libtpu reported for ``v5e:1x1``'s compile-only device (this
machine, ``scripts/tpu_prepare.sh``'s venv). ``tpu_vm`` makes this process look like the VM to
``preheat.platforms``: ``jax.devices()`` returns recorded devices.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

HBM = 16_909_336_064  # memory_stats()["bytes_limit"] of the v5e chip: 15.75 GiB
JAX_TPU = {
    "ok": True, "jax_version": "0.10.2", "result_ok": True, "backend": "tpu", "device_count": 1,
    "devices": ["TPU v5 lite"], "backend_errors": {}, "warnings": [], "elapsed_s": 9.4,
    "device": {"bytes_limit": HBM, "bytes_in_use": 26624,
               "platform_version": "PJRT C API\nTFRT TPU v5 lite\nBuilt on Jun 17 2026 11:08:48 (1781719728) cl/933746096",
               "bounds": [1, 1, 1], "cores_per_chip": 1, "process_count": 1},  # coords (0,0,0), core_on_chip 0
}
# The recorded machine is a sandbox given one chip of a v5litepod-4: no PCI bus, no hugepages file,
# no /sys/class/accel; its TPU_* variables and one vfio group say what it is.
HOST = {
    "dev": ["vfio/2", "vfio/vfio"],
    "env": {"TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_TOPOLOGY": "2x2", "TPU_WORKER_ID": "0",
            "TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "true"},
}
PCI = {"0000:00:05.0": ("0x1ae0", "0x0063")}  # a full v5e VM's chip (Google's vendor id, v5e's device id)
VERSIONS = {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": "0.0.42.1"}
# libtpu's words when the chip is taken (jax's backend error), and when its lockfile cannot be opened
# (the sentence doctor matches; what follows it varies between libtpu releases)
IN_USE = ("RuntimeError: Unable to initialize backend 'tpu': ABORTED: The TPU is already in use by process with "
          "pid {pid}. Not attempting to load libtpu.so in this process.")
LOCKFILE_ERROR = ("RuntimeError: Unable to initialize backend 'tpu': INTERNAL: Internal error when accessing libtpu "
                  "multi-process lockfile. Run \"$ sudo lsof -w /dev/vfio/2\" to figure out which process is using the TPU.")


def weights_folder(root: Path) -> Path:
    """A diffusers-shaped folder of tiny safetensors files whose bytes the tests know exactly:

        unet          proj_in (top level: never fp8) f32 128x128, an inner proj_in f32 256x256, a norm
                      f32 256, a conv f32 64x64x3x3, a weight stored F8_E4M3 64x64
        text_encoder  an embedding f32 1000x64 and int64 position ids 1x77
        vae           a conv f32 32x32x3x3 (no force_upcast in its config: True, it stays float32)

    Device bytes: float32 773736; bfloat16 407656; bfloat16 + fp8 weights 305256; bfloat16 with
    the text encoder offloaded 279040."""
    import json

    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    root = Path(root)
    f32 = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    parts = {
        "unet": ("diffusion_pytorch_model", {
            "proj_in.weight": f32(128, 128), "down_blocks.0.attentions.0.proj_in.weight": f32(256, 256),
            "down_blocks.0.resnets.0.norm1.weight": f32(256), "down_blocks.0.resnets.0.conv1.weight": f32(64, 64, 3, 3),
            "scaled.weight": np.zeros((64, 64), ml_dtypes.float8_e4m3fn)}),
        "text_encoder": ("model", {"embeddings.weight": f32(1000, 64), "position_ids": np.zeros((1, 77), np.int64)}),
        "vae": ("diffusion_pytorch_model", {"decoder.conv.weight": f32(32, 32, 3, 3)}),
    }
    index = {"_class_name": "StableDiffusionPipeline", "tokenizer": ["transformers", "CLIPTokenizer"],
             "scheduler": ["diffusers", "PNDMScheduler"], "safety_checker": [None, None]}
    for name, (stem, tensors) in parts.items():
        (root / name).mkdir(parents=True)
        save_file(tensors, str(root / name / f"{stem}.safetensors"))
        (root / name / "config.json").write_text("{}")
        index[name] = ["diffusers", name]
    for name in ("tokenizer", "scheduler"):
        (root / name).mkdir()
    (root / "model_index.json").write_text(json.dumps(index))
    return root


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


# the v5e VM's host CPU (AMD, AVX2, no AVX-512: /proc/cpuinfo's flags there, those that matter here)
VM_HOST_FLAGS = frozenset({"avx", "avx2", "fma", "f16c", "sha_ni", "vaes"})


def vm_host_cpu(monkeypatch) -> None:
    """This process's host CPU answers as the v5e VM's does: no bf16 products, so a host stage
    computes in float32 (``platforms.host_compute_dtype``); a ``PREHEAT_HOST_DTYPE`` set outside
    the test is cleared."""
    monkeypatch.delenv("PREHEAT_HOST_DTYPE", raising=False)
    monkeypatch.setattr("preheat.platforms._cpu.cpu_flags", lambda: VM_HOST_FLAGS)


def v5e_device() -> Any:
    """One v5e chip's compile-only device (``preheat warm --target v5e``'s: libtpu compiles here,
    nothing runs), or a skip where this machine has no libtpu."""
    import pytest

    from preheat.cache.targets import resolve_target, target_device
    from preheat.errors import TargetError

    try:
        return target_device(resolve_target("v5e"))
    except TargetError as exc:
        pytest.skip(str(exc))
