"""A TPU program's key fields (the TPU platform's ``device_fields``), computed by one function from
a slice's devices: a topology's compile-only devices on a CPU builder (``preheat warm --target
v5e``: ``preheat.cache.tpu_targets``), ``jax.devices()`` on the TPU VM.

On a TPU nothing is autotuned: the code is decided by the chip (its kind, megacore or not), the
slice it is compiled into (its chips' shape, its device count), libtpu's build and the flags libtpu
reads (``LIBTPU_INIT_ARGS``; jax, jaxlib and XLA_FLAGS are in every key). Never a VM's host names,
worker id or accelerator-type variables (``TPU_ACCELERATOR_TYPE=v5litepod-4`` on the lent VM that
shows one chip), which a builder does not have and which do not change the code.

libtpu's build is read from the client's ``platform_version`` ("Built on ... cl/N"): the lent VM
loads libtpu from ``TPU_LIBRARY_PATH``, not from the package whose version metadata names, and its
compile-only client on a builder says the same words (recorded: ``tests/_support/tpu_fixtures.py``).
"""

from __future__ import annotations

import functools
import os
import re
from importlib import metadata
from typing import Any, Optional

__all__ = ["tpu_fields", "libtpu_version", "libtpu_build", "libtpu_init_args", "VM_DEFAULTS"]

# What jax's Cloud TPU start (``jax._src.cloud_tpu_init``) adds to LIBTPU_INIT_ARGS on a VM with
# chips -- and only there: on a builder it returns early, having found none (the lent VM's probe:
# LIBTPU_INIT_ARGS=" --xla_tpu_use_enhanced_launch_barrier=true"). Both keys hold them, and a
# builder compiles with them (``preheat.cache.tpu_targets``), or a VM would never find its entries.
VM_DEFAULTS = ("--xla_tpu_use_enhanced_launch_barrier=true",)


@functools.lru_cache(maxsize=1)
def libtpu_version() -> Optional[str]:
    """The installed libtpu package's version (None: not installed), read the same way on a builder and a VM."""
    for name in ("libtpu", "libtpu-nightly"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def libtpu_build(platform_version: str) -> str:
    """The build of the libtpu that runs: the "Built on ... cl/N" line of a TPU client's
    ``platform_version`` (a compile-only client and a VM's say the same), or the whole text."""
    match = re.search(r"Built on .*", platform_version)
    return match.group(0).strip() if match else " ".join(platform_version.split())


def libtpu_init_args() -> str:
    """``$LIBTPU_INIT_ARGS`` as libtpu reads it on a TPU VM: jax's VM defaults added where unset."""
    args = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    for flag in VM_DEFAULTS:
        if not any(a.split("=", 1)[0] == flag.split("=", 1)[0] for a in args):
            args.append(flag)
    return " ".join(args)


def tpu_fields(devices: list[Any]) -> dict[str, Any]:
    """The key's TPU fields of a slice's devices: ``device_kind`` ("TPU v5 lite": the chip
    generation, the code's target; ``preheat cache ls`` shows it) and ``tpu``."""
    first = devices[0]
    coords = [tuple(getattr(d, "coords", (0, 0, 0))) for d in devices]
    chips = [max(c[i] for c in coords) + 1 for i in range(len(coords[0]))]
    return {"device_kind": str(first.device_kind), "tpu": {
        "cores_per_device": int(getattr(first, "num_cores", 1) or 1),  # megacore (v4, v5p) or one core
        "chips": chips,  # the slice's shape, (x, y, z)
        "devices": len(devices),
        "libtpu": libtpu_version(),
        "libtpu_build": libtpu_build(str(first.client.platform_version)),
        "libtpu_init_args": libtpu_init_args(),  # libtpu's flags (XLA's TPU options among them)
    }}
