"""The host CPU (XLA:CPU): jax's default attention, XLA's convolutions, one-pass GroupNorm, and a
key that names the host's instruction set (XLA:CPU compiles for it).

GroupNorm: the norms are memory-bound on the CPU, where one pass over the input measured 1.06-1.09x
per built-in denoiser call and 1.03-1.08x on the cifar architecture (docs/benchmarks.md, issue 21).
Convolutions: XLA's own measured fastest on the CPU (the matrix forms stay for ``PREHEAT_CONV``).
"""

from __future__ import annotations

import functools
import hashlib
import platform as _host
from pathlib import Path
from typing import Any, Optional

from preheat.platforms._base import Platform

__all__ = ["CpuPlatform", "cpu_features"]


@functools.lru_cache(maxsize=1)
def cpu_features() -> str:
    """Host CPU model + feature flags: XLA:CPU code is compiled for the host's instruction set."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return _host.processor() or _host.machine()
    model = flags = ""
    for line in text.splitlines():
        if line.startswith(("model name", "Model")) and not model:
            model = line.split(":", 1)[1].strip()
        if line.startswith(("flags", "Features")) and not flags:
            flags = " ".join(sorted(line.split(":", 1)[1].split()))
    return f"{model} | {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


class CpuPlatform(Platform):
    """XLA:CPU: jax's attention as it always ran here (``implementation=None``)."""

    name = "cpu"
    accelerator = False

    def groupnorm_form(self) -> str:
        return "one_pass"

    def device_fields(self, device: Any, mesh_size: Optional[int], target: Any = None) -> dict[str, Any]:
        """The generic fields plus the host's instruction set."""
        return {**super().device_fields(device, mesh_size, target), "host_cpu": cpu_features()}
