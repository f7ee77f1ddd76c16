"""The device a program traced now is compiled for: the running backend's first device, or,
during a deviceless compile (``preheat warm --target``: traced on the CPU for a GPU it does not
have), the target that ``compiling_for`` names. Trace-time choices that depend on the platform
(attention's implementation, GroupNorm's statistics) read it here, so a builder traces the
program the pod would trace for itself.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import jax

__all__ = ["compiling_for", "traced_target", "deviceless"]

# (platform, (major, minor)) of the device a trace compiles for, when it is not the running one. A
# jax user context, not a plain context variable: its value is part of jit's tracing and lowering
# caches, so a function traced for the target is never reused for the CPU, nor the reverse.
_TARGET = jax.make_user_context(default_value=None)


@contextlib.contextmanager
def compiling_for(platform: str, capability: Optional[tuple[int, int]]) -> Iterator[None]:
    """Trace for ``platform`` at compute ``capability`` (a deviceless compile), not the running backend."""
    with _TARGET((platform, None if capability is None else tuple(capability))):
        yield


def traced_target() -> tuple[str, Optional[tuple[int, int]]]:
    """(platform, compute capability or None) of the device the program traced now is compiled for."""
    chosen = _TARGET.value
    if chosen is not None:
        return chosen
    device = jax.devices()[0]
    if device.platform != "gpu":
        return device.platform, None
    try:
        major, minor = str(device.compute_capability).split(".")[:2]
        return "gpu", (int(major), int(minor))
    except (AttributeError, ValueError):
        return "gpu", None


def deviceless() -> bool:
    """Whether the program traced now is compiled for a device this process does not have
    (``compiling_for``: ``preheat warm --target``), so nothing can be timed or built for it: no
    autotuning, no library algorithm picked by measuring (cuDNN's convolutions), no cuDNN graph
    (fused attention)."""
    return _TARGET.value is not None
