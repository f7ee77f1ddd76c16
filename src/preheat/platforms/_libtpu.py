"""libtpu as a TPU program's key reads it, the same on a TPU VM and on a CPU-only builder that
compiles for one (``preheat warm --target v5e``: ``preheat.cache.tpu_targets``).

The TPU platform's key (``TpuPlatform.device_fields``) holds the chip's kind and its client's
``platform_version`` -- libtpu's build ("Built on ... cl/N"): the lent VM loads libtpu from
``TPU_LIBRARY_PATH`` and its client says the same words as a builder's compile-only client with the
same libtpu (recorded: ``tests/_support/tpu_fixtures.py``) -- and ``LIBTPU_INIT_ARGS``, read here as
libtpu reads it on a VM: jax's Cloud TPU start (``jax._src.cloud_tpu_init``) appends its
launch-barrier flag on a VM with chips, and only there (a builder has none; the lent VM's probe:
``LIBTPU_INIT_ARGS=" --xla_tpu_use_enhanced_launch_barrier=true"``). Never a VM's host names, worker
id or accelerator-type variables (``TPU_ACCELERATOR_TYPE=v5litepod-4`` on the lent VM that shows
one chip), which a builder does not have and which do not change the code.
"""

from __future__ import annotations

import functools
import os
from importlib import metadata
from typing import Any, Optional

__all__ = ["libtpu_version", "libtpu_init_args", "slice_description", "VM_DEFAULTS"]

VM_DEFAULTS = ("--xla_tpu_use_enhanced_launch_barrier=true",)


@functools.lru_cache(maxsize=1)
def libtpu_version() -> Optional[str]:
    """The installed libtpu package's version (None: not installed)."""
    for name in ("libtpu", "libtpu-nightly"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def libtpu_init_args() -> str:
    """``$LIBTPU_INIT_ARGS`` as libtpu reads it on a TPU VM: jax's VM defaults added where unset,
    whitespace normalised (a builder sets the result before libtpu loads, so it compiles with them)."""
    args = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    for flag in VM_DEFAULTS:
        if not any(a.split("=", 1)[0] == flag.split("=", 1)[0] for a in args):
            args.append(flag)
    return " ".join(args)


def slice_description(devices: list[Any]) -> dict[str, Any]:
    """A TPU slice's devices described for people (a ``warm --target`` manifest, the chip check):
    chips per axis, device count, cores per device (megacore v4/v5p: 2), libtpu's version. Not the key."""
    coords = [tuple(getattr(d, "coords", (0, 0, 0))) for d in devices]
    return {"chips": [max(c[i] for c in coords) + 1 for i in range(len(coords[0]))], "devices": len(devices),
            "cores_per_device": int(getattr(devices[0], "num_cores", 1) or 1), "libtpu": libtpu_version()}
