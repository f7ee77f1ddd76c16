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

The key (``tpu_fields``) is computed by one function from a list of devices: the topology's
compile-only devices on a builder, ``jax.devices()`` on the VM. It holds the chip (device kind,
cores per device), the slice (its chips' shape, its device count), libtpu's build and
``LIBTPU_INIT_ARGS`` -- never a TPU VM's host name, worker id or accelerator-type variable, which
the deviceless path does not have and which do not change the code. jax, jaxlib and the XLA flags
a TPU reads are in every accelerator's key (``preheat.cache.keys``).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Optional

from preheat.errors import TargetError

__all__ = ["KINDS", "TpuTarget", "is_tpu_spec", "resolve_tpu_target", "tpu_fields", "libtpu_version",
           "libtpu_build", "libtpu_init_args", "tpu_device", "topology_devices"]


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
    ``fields``: the key's device fields, filled by ``tpu_device`` (they need libtpu)."""

    name: str
    kind: str
    chips: tuple[int, int, int]
    fields: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    platform = "tpu"
    capability = None  # what ``compile_target.compiling_for`` is given: no compute capability on a TPU

    @property
    def topology_name(self) -> str:
        spec = KINDS[self.kind]
        return f"{spec.topology}:{'x'.join(str(c) for c in self.chips[:spec.dims])}"

    def key_fields(self) -> dict[str, Any]:
        """The key's TPU fields (``tpu_fields`` of the topology's devices)."""
        if not self.fields:
            self.fields.update(tpu_fields(topology_devices(self)))
        return dict(self.fields)

    def manifest(self) -> dict[str, Any]:
        """What an entry compiled for this target records about it (not part of the key)."""
        fields = self.key_fields()
        return {"name": self.name, "platform": "tpu", "device": fields["device_kind"],
                "libtpu": fields["tpu"]["libtpu"]}


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


def tpu_fields(devices: list[Any]) -> dict[str, Any]:
    """The key's TPU fields, from the slice's devices (a topology's on a builder, ``jax.devices()``
    on a VM): ``device_kind`` ("TPU v5 lite": the chip generation, the code's target) and ``tpu``."""
    first = devices[0]
    coords = [tuple(getattr(d, "coords", (0, 0, 0))) for d in devices]
    chips = [max(c[i] for c in coords) + 1 for i in range(len(coords[0]))]
    return {"device_kind": str(first.device_kind), "tpu": {
        "cores_per_device": int(getattr(first, "num_cores", 1) or 1),  # megacore (v4, v5p) or one core
        "chips": chips,  # the slice's shape, (x, y, z)
        "devices": len(devices),
        "libtpu": libtpu_version(),
        "libtpu_build": libtpu_build(str(first.client.platform_version)),
        # libtpu's own flags (XLA's TPU options among them) decide the code as XLA_FLAGS do
        "libtpu_init_args": libtpu_init_args(),
    }}


# What jax's Cloud TPU start (``jax._src.cloud_tpu_init``) adds to LIBTPU_INIT_ARGS on a VM with
# chips -- and only there: on a builder it returns before, having found none. A builder compiles
# with them too (``topology_devices``) and both keys hold them, or a VM would never find a
# builder's entries.
_VM_DEFAULTS = ("--xla_tpu_use_enhanced_launch_barrier=true",)


def libtpu_init_args() -> str:
    """``$LIBTPU_INIT_ARGS`` as libtpu reads it on a TPU VM: jax's VM defaults added where unset."""
    args = os.environ.get("LIBTPU_INIT_ARGS", "").split()
    for flag in _VM_DEFAULTS:
        if not any(a.split("=", 1)[0] == flag.split("=", 1)[0] for a in args):
            args.append(flag)
    return " ".join(args)


@functools.lru_cache(maxsize=None)
def _topology(name: str, bounds: tuple[int, int, int], chip_config: Optional[str]) -> tuple[Any, ...]:
    from jax.experimental import topologies

    extra = {"chip_config_name": chip_config} if chip_config else {}
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=name, chips_per_host_bounds=bounds,
                                              num_slices=1, **extra).devices)


def topology_devices(target: TpuTarget) -> list[Any]:
    """The compile-only devices of ``target``'s slice; without libtpu (or with one that does not
    know the chip), one line naming what to install."""
    if libtpu_version() is None:
        raise TargetError(f"--target {target.name} needs libtpu for deviceless TPU compiles: pip install "
                          "'preheat[tpu]' (the libtpu release of this jax version; the TPU VM must run the same one)",
                          reason="plugin")
    from preheat.cache.targets import compile_only_platforms

    compile_only_platforms()  # never start a TPU client of its own: a builder has no chip
    os.environ["LIBTPU_INIT_ARGS"] = libtpu_init_args()  # the VM's flags, before libtpu is loaded
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
