"""Which platform a choice is made for: the compile target, not the running backend.

The device a program traced now is compiled for is the running backend's first device, or,
during a deviceless compile (``preheat warm --target``: traced on the CPU for a device it does not
have), the target that ``compiling_for`` names. ``current()`` is that target's platform
description, so a builder traces the program the pod would trace for itself. A test selects a
platform description of its own (``FakePlatform``) with ``selected``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import jax

from preheat.platforms._base import Platform
from preheat.platforms._cpu import CpuPlatform
from preheat.platforms._gpu import GpuPlatform
from preheat.platforms._tpu import TpuPlatform

__all__ = ["PLATFORMS", "get", "current", "local", "selected", "compiling_for", "traced_target", "deviceless",
           "on_host"]

# One description per platform preheat knows, by jax's platform name of its devices.
PLATFORMS: dict[str, Platform] = {p.name: p for p in (CpuPlatform(), GpuPlatform(), TpuPlatform())}

# (platform, capability) of the device a trace compiles for, when it is not the running one, and
# the platform description a test selected. jax user contexts, not plain context variables: their
# values are part of jit's tracing and lowering caches, so a function traced for the target (or the
# fake) is never reused for the CPU, nor the reverse.
_TARGET = jax.make_user_context(default_value=None)
_SELECTED = jax.make_user_context(default_value=None)
# True while a stage is traced and run on the host's CPU beside the accelerator (``on_host``: text
# encoders kept there): its choices are the CPU's, whatever the local devices are.
_HOST = jax.make_user_context(default_value=False)


def get(name: str) -> Platform:
    """The description of platform ``name`` (a generic one for a platform preheat does not describe)."""
    return PLATFORMS.get(name) or Platform(name)


@contextlib.contextmanager
def compiling_for(platform: str, capability: Any = None) -> Iterator[None]:
    """Trace for ``platform`` (at ``capability``: a GPU's (major, minor), or None) in a deviceless
    compile, not for the running backend."""
    if isinstance(capability, list):
        capability = tuple(capability)
    with _TARGET((platform, capability)):
        yield


def traced_target() -> tuple[str, Any]:
    """(platform, capability or None) of the device the program traced now is compiled for."""
    chosen = _TARGET.value
    if chosen is not None:
        return chosen
    if _HOST.value:
        return "cpu", None
    device = jax.devices()[0]
    if device.platform != "gpu":
        return device.platform, None
    try:
        major, minor = str(device.compute_capability).split(".")[:2]
        return "gpu", (int(major), int(minor))
    except (AttributeError, ValueError):
        return device.platform, None


def deviceless() -> bool:
    """Whether the program traced now is compiled for a device this process does not have
    (``compiling_for``: ``preheat warm --target``), so nothing can be timed or built for it: no
    autotuning, no library algorithm picked by measuring (cuDNN's convolutions), no cuDNN graph
    (fused attention)."""
    return _TARGET.value is not None


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Trace (and run) for the host's CPU beside the accelerator: a stage whose weights live there
    (``preheat.load(encoders_on="host")``) is the CPU's program, not a deviceless one (the CPU is here)."""
    with _HOST(True):
        yield



@contextlib.contextmanager
def selected(platform: Platform) -> Iterator[Platform]:
    """Make ``platform`` (a test's ``FakePlatform``) answer every platform question in this
    context, whatever the target or the running backend."""
    with _SELECTED(platform):
        yield platform


def current() -> Platform:
    """The description of the platform the program traced now is compiled for."""
    chosen = _SELECTED.value
    return chosen if chosen is not None else get(traced_target()[0])


def local() -> Platform:
    """The description of the platform this process's devices are (what runs its programs)."""
    chosen = _SELECTED.value
    return chosen if chosen is not None else get(jax.devices()[0].platform)
