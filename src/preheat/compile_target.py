"""The device a program traced now is compiled for: the running backend's first device, or,
during a deviceless compile (``preheat warm --target``: traced on the CPU for a GPU it does not
have), the target that ``compiling_for`` names. Trace-time choices that depend on the platform
(attention's implementation, GroupNorm's statistics) read it here, so a builder traces the
program the pod would trace for itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import jax

__all__ = ["compiling_for", "traced_target"]

# (platform, (major, minor)) of the device a trace compiles for, when it is not the running one.
_TARGET: contextvars.ContextVar[Optional[tuple[str, Optional[tuple[int, int]]]]] = contextvars.ContextVar(
    "preheat_compile_target", default=None)


@contextlib.contextmanager
def compiling_for(platform: str, capability: Optional[tuple[int, int]]) -> Iterator[None]:
    """Trace for ``platform`` at compute ``capability`` (a deviceless compile), not the running backend."""
    token = _TARGET.set((platform, capability))
    try:
        yield
    finally:
        _TARGET.reset(token)


def traced_target() -> tuple[str, Optional[tuple[int, int]]]:
    """(platform, compute capability or None) of the device the program traced now is compiled for."""
    chosen = _TARGET.get()
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
