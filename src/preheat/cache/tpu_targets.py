"""TPU compile targets: compiling a TPU VM's programs on a CPU-only builder (``preheat warm --target v5e``).

On a TPU nothing is autotuned: XLA's code for a TPU is decided by the chip, the topology the
program is compiled into, libtpu's compiler and the flags it reads. With libtpu installed,
``jax.experimental.topologies.get_topology_desc`` describes a slice of TPUs without one (the
builder needs no chip, no driver, no metadata server): its devices are compile-only devices
that programs lower and compile for on the CPU, and the executables serialise like any other.
MaxText's ``train_compile.py`` does the same for training; here it serves the serving programs.

A target is written ``KIND`` or ``KIND:SHAPE`` (``v5e``, ``v5e:2x2``, ``v5p``, ``v6e:2x4``, ``v4``),
with libtpu's own topology names (``KINDS``). One host's chips only: ``warm`` compiles
single-device programs, and a VM is one host.

The key's TPU fields (the TPU platform's ``device_fields``) are read from a device the same way on
both sides: the chip's kind and its client's ``platform_version`` (libtpu's build), from the
topology's first compile-only device here and from the VM's own first device there. The slice's
shape is not in them (the TPU platform's choice: a single-chip program taken as the same on a 1-chip
and a 4-chip host, not measured), only in the entry's manifest. So the builder must have the VM's
jax, jaxlib and libtpu.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from preheat.errors import TargetError
from preheat.platforms import chip_fields, key_device_label, libtpu_init_args, libtpu_version, slice_description

__all__ = ["KINDS", "TpuTarget", "is_tpu_spec", "resolve_tpu_target", "tpu_device", "topology_devices"]


@dataclass(frozen=True)
class Kind:
    """One TPU generation as libtpu names it, and the single-host slices of it a VM has."""

    topology: str  # libtpu's prefix of a topology name ("v5e" in "v5e:2x2")
    default: str  # the smallest VM's chips (a v5p or v4 VM has 4)
    host_max: tuple[int, int, int]  # the most chips one host holds, per axis
    dims: int  # 2 (a 2-D torus: v5e, v6e) or 3 written in the shape
    chip_config: Optional[str] = None  # "megacore": one device per chip of two cores, as jax uses them


# Short name -> libtpu's. v4 and v5p chips have two TensorCores that jax drives as one device
# (megacore); a topology of them without ``chip_config_name="megacore"`` lists a device per core.
KINDS: dict[str, Kind] = {
    "v5e": Kind("v5e", "1x1", (2, 4, 1), 2),
    "v6e": Kind("v6e", "1x1", (2, 4, 1), 2),
    "v5p": Kind("v5p", "2x2x1", (2, 2, 1), 3, "megacore"),
    "v4": Kind("v4", "2x2x1", (2, 2, 1), 3, "megacore"),
}
_SPEC = re.compile(r"^(?P<kind>[a-z0-9]+)(?::(?P<shape>[^\s]*))?$")


@dataclass(frozen=True)
class TpuTarget:
    """A TPU slice to compile for: ``name`` (``v5e:1x1``), its kind and chips per axis (3 values).
    ``fields``: the key's chip fields, filled by ``key_fields`` (they need libtpu)."""

    name: str
    kind: str
    chips: tuple[int, int, int]
    fields: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    platform = "tpu"
    capability = None  # what ``platforms.compiling_for`` is given: no compute capability on a TPU

    @property
    def topology_name(self) -> str:
        spec = KINDS[self.kind]
        return f"{spec.topology}:{'x'.join(str(c) for c in self.chips[:spec.dims])}"

    def key_fields(self) -> dict[str, Any]:
        """What a chip's host reads from its first device (the TPU platform's ``device_fields``
        adds the device count and the flags): its kind and its client's ``platform_version``."""
        if not self.fields:
            self.fields.update(chip_fields(topology_devices(self)[0]))
        return dict(self.fields)

    def compile_device(self) -> Any:
        """The compile-only device a single-device program for this slice is compiled on (``target_device``)."""
        return tpu_device(self)

    def manifest(self) -> dict[str, Any]:
        """What an entry compiled for this target records about it (not part of the key)."""
        return {"name": self.name, "platform": self.platform, "device": key_device_label(self.key_fields()),
                **slice_description(topology_devices(self))}


def is_tpu_spec(spec: str) -> bool:
    """Whether ``--target SPEC`` names a TPU (``KIND`` or ``KIND:SHAPE`` of a known kind)."""
    match = _SPEC.match(spec.strip().lower())
    return bool(match) and match.group("kind") in KINDS


def resolve_tpu_target(spec: str) -> TpuTarget:
    """``--target v5e|v5e:2x2|v5p|v6e|v4`` -> a TpuTarget; a malformed or multi-host shape fails in one line.
    Needs no libtpu (``tpu_device`` does)."""
    text = spec.strip().lower()
    match = _SPEC.match(text)
    if not match or match.group("kind") not in KINDS:
        raise TargetError(f"--target {spec!r}: not a TPU ({', '.join(KINDS)}, optionally :SHAPE)", reason="unknown")
    kind = KINDS[match.group("kind")]
    shape = match.group("shape") or kind.default
    parts = shape.split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts) or len(parts) not in (kind.dims, 3):
        example = "2x2" if kind.dims == 2 else "2x2x1"
        raise TargetError(f"--target {spec}: {shape!r} is not a {match.group('kind')} topology (chips per axis, "
                          f"e.g. {match.group('kind')}:{example})", reason="malformed")
    chips = tuple(int(p) for p in parts) + (1,) * (3 - len(parts))
    if any(c > m for c, m in zip(chips, kind.host_max)):
        most = "x".join(str(m) for m in kind.host_max[:kind.dims])
        raise TargetError(f"--target {spec}: more chips than one host holds ({most} at most): warm compiles a "
                          "VM's single-device programs, for one host", reason="unknown")
    name = f"{match.group('kind')}:{'x'.join(str(c) for c in chips[:kind.dims])}"
    return TpuTarget(name=name, kind=match.group("kind"), chips=chips)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=None)
def _topology(name: str, bounds: tuple[int, int, int], chip_config: Optional[str]) -> tuple[Any, ...]:
    from jax.experimental import topologies

    extra = {"chip_config_name": chip_config} if chip_config else {}
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name, chips_per_host_bounds=bounds,
                                              num_slices=1, **extra).devices)


def _cpu_only() -> None:
    """Run this process on the CPU when the user chose no platforms and JAX has not started: it
    compiles for a TPU it does not have, and a builder's jax would otherwise try to start a TPU
    client of its own (as ``cache.targets.compile_only_platforms`` does for the CUDA plugin)."""
    import jax
    from jax._src import xla_bridge

    if not jax.config.jax_platforms and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def topology_devices(target: TpuTarget) -> list[Any]:
    """The compile-only devices of ``target``'s slice; without libtpu (or with one that does not
    know the chip), one line naming what to install."""
    if libtpu_version() is None:
        raise TargetError(f"--target {target.name} needs libtpu for deviceless TPU compiles: pip install "
                          "'preheat[tpu]' (the libtpu release of this jax version; the TPU VM must run the same one)",
                          reason="plugin")
    _cpu_only()
    os.environ["LIBTPU_INIT_ARGS"] = libtpu_init_args()  # the VM's flags, before libtpu is loaded
    # libtpu takes /tmp/libtpu_lockfile so that one process at a time drives a VM's chips; a builder
    # drives none, and two builds on one machine (a test suite's workers, two warm jobs) would
    # otherwise fail "Internal error when accessing libtpu multi-process lockfile"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return list(_topology(target.topology_name, target.chips, KINDS[target.kind].chip_config))
    except Exception as exc:  # libtpu refused the name (a chip this release does not know)
        first = (str(exc).splitlines() or [""])[0][:200]
        raise TargetError(f"--target {target.name}: libtpu {libtpu_version()} cannot describe this topology ({first})",
                          reason="unknown") from None


def tpu_device(target: TpuTarget) -> Any:
    """The compile-only device a single-device program for ``target`` is compiled on (its first chip)."""
    devices = topology_devices(target)
    target.key_fields()
    return devices[0]
