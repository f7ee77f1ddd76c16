"""The checks, one module per area, in the order doctor runs and shows them.

Each module registers its checks as ``Check`` objects; ``CHECKS`` lists them. A test replaces one
with ``monkeypatch.setattr(the_check, "run", fake)``.
"""

from __future__ import annotations

from preheat.doctor.checks.accelerator import ACCELERATOR
from preheat.doctor.checks.cache_health import CACHE_HEALTH
from preheat.doctor.checks.cuda_libs import CUDA_LIBS, LD_LIBRARY_PATH
from preheat.doctor.checks.gpu_memory import GPU_MEMORY
from preheat.doctor.checks.jax_backend import JAX
from preheat.doctor.checks.pytorch import TORCH
from preheat.doctor.checks.storage import STORAGE_CACHE, STORAGE_HF
from preheat.doctor.results import Check

CHECKS: tuple[Check, ...] = (
    ACCELERATOR,
    JAX,
    TORCH,
    CUDA_LIBS,
    LD_LIBRARY_PATH,
    GPU_MEMORY,
    STORAGE_CACHE,
    STORAGE_HF,
    CACHE_HEALTH,
)
