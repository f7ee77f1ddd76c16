"""The host CPU (XLA:CPU): jax's default attention, XLA's convolutions, one-pass GroupNorm, a key
that names the host's instruction set (XLA:CPU compiles for it), and the dtype a stage run on the host
beside an accelerator computes in (``host_compute_dtype``).

GroupNorm: the norms are memory-bound on the CPU, where one pass over the input measured 1.06-1.09x
per built-in denoiser call and 1.03-1.08x on the cifar architecture (docs/benchmarks.md, issue 21).
Convolutions: XLA's own measured fastest on the CPU (the matrix forms stay for ``PREHEAT_CONV``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform as _host
from pathlib import Path
from typing import Any, Optional

from preheat.platforms._base import Platform

__all__ = ["CpuPlatform", "cpu_features", "cpu_flags", "host_compute_dtype", "host_dtype_setting",
           "HOST_DTYPE_SETTINGS"]

# the flags of a CPU that multiplies a half type natively: x86's AVX512 and AMX forms, Arm's Features
NATIVE_HALF_FLAGS = {"bfloat16": frozenset({"avx512_bf16", "amx_bf16", "bf16"}),
                     "float16": frozenset({"avx512_fp16", "amx_fp16", "asimdhp"})}
HOST_DTYPE_SETTINGS = ("auto", "float32", "as-loaded")  # PREHEAT_HOST_DTYPE


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, tuple[str, ...]]:
    """(model name, sorted feature flags) of the host's first CPU; ("", ()) where /proc has none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "", ()
    model, flags = "", ()
    for line in text.splitlines():
        if line.startswith(("model name", "Model")) and not model:
            model = line.split(":", 1)[1].strip()
        if line.startswith(("flags", "Features")) and not flags:
            flags = tuple(sorted(line.split(":", 1)[1].split()))
    return model, flags


def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags (x86's ``flags``, Arm's ``Features``)."""
    return frozenset(_cpuinfo()[1])


def cpu_features() -> str:
    """Host CPU model + feature flags: XLA:CPU code is compiled for the host's instruction set."""
    model, flags = _cpuinfo()
    if not model and not flags:
        return _host.processor() or _host.machine()
    return f"{model} | {hashlib.sha256(' '.join(flags).encode()).hexdigest()[:16]}"


def host_dtype_setting() -> str:
    """``PREHEAT_HOST_DTYPE`` (default ``auto``), one of ``HOST_DTYPE_SETTINGS``: a one-line error otherwise."""
    from preheat.errors import InvalidArgumentError

    setting = os.environ.get("PREHEAT_HOST_DTYPE", "auto")
    if setting not in HOST_DTYPE_SETTINGS:
        raise InvalidArgumentError(f"PREHEAT_HOST_DTYPE={setting!r}; supported: {', '.join(HOST_DTYPE_SETTINGS)}",
                                   argument="PREHEAT_HOST_DTYPE")
    return setting


def host_compute_dtype(dtype: str, flags: Optional[frozenset[str]] = None) -> str:
    """The dtype a stage kept and run on the host's CPU beside an accelerator computes in
    (``encoders_on="host"``): ``dtype``, except float32 for a half type this CPU has no native
    products for. XLA:CPU converts every such product: on a TPU v5e VM's AMD host (AVX2, no AVX512)
    a 512 x 4096 x 10240 product ran at 1.13 TFLOP/s in float32 and 0.30 in bfloat16 (docs/tpu.md),
    so T5-XXL's encode is several times faster in float32, at twice the host memory.
    ``PREHEAT_HOST_DTYPE``: ``auto`` (this rule), ``float32``, or ``as-loaded`` (``dtype`` always)."""
    setting = host_dtype_setting()
    dtype = str(dtype)
    if dtype not in NATIVE_HALF_FLAGS or setting == "as-loaded":
        return dtype
    if setting == "float32":
        return "float32"
    return dtype if NATIVE_HALF_FLAGS[dtype] & (cpu_flags() if flags is None else flags) else "float32"


class CpuPlatform(Platform):
    """XLA:CPU: jax's attention as it always ran here (``implementation=None``)."""

    name = "cpu"
    accelerator = False

    def groupnorm_form(self) -> str:
        return "one_pass"

    def device_fields(self, device: Any, mesh_size: Optional[int], target: Any = None) -> dict[str, Any]:
        """The generic fields plus the host's instruction set."""
        return {**super().device_fields(device, mesh_size, target), "host_cpu": cpu_features()}
