"""The checks, one module per area, in the order doctor runs and shows them.

Each module registers its checks as ``Check`` objects. Which run depends on the machine, told by
the host itself (``Context.platform``), never by JAX, which may be what is broken:

    CHECKS_FOR["gpu"]   an NVIDIA GPU: the driver, the JAX build for it, CUDA libraries, GPU memory
    CHECKS_FOR["tpu"]   a TPU VM: the chips, JAX on them, libtpu's lockfile, hugepages, TPU memory
    CHECKS_FOR["cpu"]   neither: the GPU list, whose rows say there is no accelerator

``COMMON`` (storage, cache, and ``--model``'s fit) ends every list. ``CHECKS`` is every check once.
A test replaces one with ``monkeypatch.setattr(the_check, "run", fake)``.
"""

from __future__ import annotations

from preheat.doctor.checks.accelerator import ACCELERATOR
from preheat.doctor.checks.cache_health import CACHE_HEALTH
from preheat.doctor.checks.cuda_libs import CUDA_LIBS, LD_LIBRARY_PATH
from preheat.doctor.checks.gpu_memory import GPU_MEMORY
from preheat.doctor.checks.jax_backend import JAX
from preheat.doctor.checks.model_fit import MODEL_FIT
from preheat.doctor.checks.pytorch import TORCH
from preheat.doctor.checks.storage import STORAGE_CACHE, STORAGE_HF
from preheat.doctor.checks.tpu import TPU_ACCELERATOR, TPU_HUGEPAGES, TPU_JAX, TPU_MEMORY
from preheat.doctor.results import Check

COMMON: tuple[Check, ...] = (MODEL_FIT, STORAGE_CACHE, STORAGE_HF, CACHE_HEALTH)
GPU_CHECKS: tuple[Check, ...] = (ACCELERATOR, JAX, TORCH, CUDA_LIBS, LD_LIBRARY_PATH, GPU_MEMORY)
TPU_CHECKS: tuple[Check, ...] = (TPU_ACCELERATOR, TPU_JAX, TORCH, TPU_HUGEPAGES, TPU_MEMORY)
CHECKS_FOR: dict[str, tuple[Check, ...]] = {
    "gpu": GPU_CHECKS + COMMON,
    "tpu": TPU_CHECKS + COMMON,
    "cpu": GPU_CHECKS + COMMON,
}
CHECKS: tuple[Check, ...] = tuple({id(c): c for checks in CHECKS_FOR.values() for c in checks}.values())


def checks_for(platform: str) -> tuple[Check, ...]:
    """The checks that apply on ``platform`` ("cpu", "gpu", "tpu"), in the order doctor shows them."""
    return CHECKS_FOR.get(platform, CHECKS_FOR["cpu"])
