"""GPU compile targets: compiling a GPU's programs on a machine without one (``preheat warm --target``).

A target is XLA's description of a GPU (a ``GpuTargetConfigProto`` in text form). XLA publishes
them for the common data-centre cards; preheat ships those (``preheat/assets/gpu_targets``,
with XLA's license) under short names (``NAMES``). For a GPU XLA does not describe, ``preheat
doctor --save-target FILE`` on a pod with that GPU writes its own description, and ``warm
--target FILE`` reads it. With the CUDA plugin installed, ``jax.experimental.topologies``
turns a description into a compile-only device: programs lower and compile for it on the CPU
(no driver, no GPU), and serialise like any other executable.

The cache key of a GPU program (``preheat.platforms.gpu_fields``, the GPU platform's description)
holds what decides whether its generated code runs on a card -- compute capability and feature
extension, core count, the thread, register and shared-memory limits -- read from the description,
never the card's marketing name (XLA's H200 file says ``NVIDIA H200 141GB HBM3e``, the card says
``NVIDIA H200``), its clocks, bandwidth, memory or L2 size. Those differ between boards of one chip
and between XLA's file and the card it describes (the lent H200 reports another ``l2_cache_size``
than XLA's file: docs/gpu.md, first run), and they only steer XLA's cost heuristics, which the
pod's autotuned recompile (``cache.retune``) revisits anyway. A pod computes the same fields from
its own device's description (``preheat.platforms.local_description``), so the entries a CPU
builder writes for it are the ones its first start looks up.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from preheat.errors import TargetError
from preheat.platforms import (cuda_versions, describe_device, devices_of, gpu_fields, local_description,
                               parse_description)

__all__ = ["Target", "NAMES", "resolve_target", "target_device", "compile_only_platforms", "save_target"]

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "gpu_targets"
# Short name -> XLA's published description (None: XLA publishes none; save one on such a pod).
NAMES: dict[str, Optional[str]] = {
    "h200": "h200.txtpb",
    "h100-sxm": "h100_sxm.txtpb",
    "h100-pcie": "h100_pcie.txtpb",
    "a100-80": "a100_sxm_80.txtpb",
    "a100-40": "a100_sxm_40.txtpb",
    "b200": "b200.txtpb",
    "l40s": None,
    "rtx4090": None,
}
@dataclass(frozen=True)
class Target:
    """A GPU to compile for: ``name`` (a short name or the description file's path), the
    description's text, and the key's GPU fields computed from it."""

    name: str
    text: str
    gpu: dict[str, Any]
    platform = "gpu"  # the platform whose description keys and traces for it (``preheat.platforms``)

    def compile_device(self) -> Any:
        """The compile-only device this GPU's programs are compiled on (``target_device``)."""
        return gpu_device(self)

    @property
    def capability(self) -> tuple[int, int]:
        """The compute capability the models' trace-time choices read (``preheat.platforms.compiling_for``)."""
        return tuple(self.gpu["compute_capability"])  # type: ignore[return-value]

    @property
    def device_name(self) -> str:
        return str(parse_description(self.text, self.name).get("device_description_str", [""])[0])

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]

    def manifest(self) -> dict[str, Any]:
        """What an entry compiled for this target records about it (not part of the key)."""
        return {"name": self.name, "device": self.device_name, "description_sha256": self.digest}


def resolve_target(spec: str) -> Any:
    """``--target NAME|FILE`` -> a Target (a GPU) or a ``tpu_targets.TpuTarget`` (``v5e``,
    ``v5e:2x2``, ...); an unknown name or a malformed file fails in one line."""
    from preheat.cache.tpu_targets import is_tpu_spec, resolve_tpu_target

    spec = spec.strip()
    if is_tpu_spec(spec):
        return resolve_tpu_target(spec)
    if spec.lower() in NAMES:
        name = spec.lower()
        file = NAMES[name]
        if file is None:
            raise TargetError(f"--target {name}: XLA publishes no description of this GPU; run `preheat doctor "
                              f"--save-target {name}.txtpb` on a pod with one and pass --target {name}.txtpb",
                              reason="unknown")
        path = ASSETS / file
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise TargetError(f"--target {spec!r} is neither a known GPU ({', '.join(NAMES)}) nor a description "
                              "file", reason="unknown")
        name = str(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TargetError(f"--target {spec}: cannot read the description ({type(exc).__name__})",
                          reason="malformed") from None
    return Target(name=name, text=text, gpu=gpu_fields(text, name))


def compile_only_platforms() -> None:
    """Let the CUDA plugin register on a machine with no usable GPU (a CPU builder).

    Unless the platforms are chosen, the plugin checks the CUDA driver when it registers and, on a
    builder with no driver, does not register at all -- and with it goes the topology a deviceless
    compile needs ("topology not implemented for cuda"). A process that compiles for a target
    runs nothing on a GPU of its own, so when the user chose no platforms and JAX has not started
    yet, it runs on the CPU: the plugin then registers without that check, as in jax's own
    deviceless tests. Called before JAX starts (``warm --target``, ``benchmarks/target.py``)."""
    import jax
    from jax._src import xla_bridge

    if not jax.config.jax_platforms and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


@functools.lru_cache(maxsize=None)
def _compile_only_device(text: str) -> Any:
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1").devices[0]


def target_device(target: Any) -> Any:
    """The compile-only device for ``target`` (a GPU's ``Target`` or a ``tpu_targets.TpuTarget``:
    each makes its own); without a CUDA plugin or libtpu (or on a jax that cannot compile for an
    absent GPU), one line naming what to install."""
    return target.compile_device()


def gpu_device(target: "Target") -> Any:
    """``Target.compile_device``: the CUDA plugin's compile-only device for this description."""
    if not any(k.startswith("jax-cuda") for k in cuda_versions()):
        raise TargetError("--target needs the CUDA plugin for deviceless GPU compiles: pip install "
                          "'preheat[cuda13]' (jax-cuda13-plugin and jax-cuda13-pjrt, the jax version's own)",
                          reason="plugin")
    compile_only_platforms()
    try:
        return _compile_only_device(target.text)
    except ImportError as exc:
        raise TargetError(f"--target: this jax cannot compile for an absent GPU ({type(exc).__name__}); "
                          "jax/jaxlib 0.11.2 with jax-cuda13-plugin can", reason="plugin") from None
    except NotImplementedError:  # the plugin did not register: JAX started first, with no usable GPU here
        raise TargetError("--target: JAX's CUDA plugin did not register in this process (no usable GPU, and JAX "
                          "started before the target was set); run it with JAX_PLATFORMS=cpu", reason="plugin") from None
    except Exception as exc:  # XLA refused the description (a field of another XLA version, a bad value)
        first = (str(exc).splitlines() or [""])[0][:200]
        raise TargetError(f"--target {target.name}: XLA cannot use this description ({first})",
                          reason="malformed") from None


def save_target(path: Path) -> Target:
    """``preheat doctor --save-target FILE``: write this machine's first GPU's description (for
    ``warm --target FILE`` on a builder), atomically; one line when there is no GPU."""
    from preheat.files import atomic_write_bytes

    gpus = devices_of("gpu")
    if not gpus:
        raise TargetError("--save-target needs a GPU that JAX can use on this machine (see `preheat doctor`)",
                          reason="plugin", argument="save_target")
    text = local_description(gpus[:1])
    gpu_fields(text, "this GPU's description")  # the pod's own text must parse as a target does
    kind = describe_device(gpus[0])["device"]
    header = f"# {kind}: written by `preheat doctor --save-target` for `preheat warm --target FILE`\n"
    atomic_write_bytes(Path(path), (header + text).encode())
    return Target(name=str(path), text=header + text, gpu=gpu_fields(text))
