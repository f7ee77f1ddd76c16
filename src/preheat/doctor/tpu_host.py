"""Facts: is this a TPU VM, read from the host alone (no JAX), and what on it stops the TPU runtime.

JAX's answer ("which backend am I on") is the probe's; this module answers the questions JAX cannot
when it is the thing that is wrong: a jax without libtpu runs on the CPU without a word, so the
host itself must say that a TPU is attached. The evidence, each enough on its own:

    PCI        /sys/bus/pci/devices/*/vendor 0x1ae0 (Google) with a TPU device id: what JAX's own
               ``hardware_utils`` counts (the chip generation comes from the id)
    accel      /dev/accel<N> device nodes (TPU v2-v4 VMs) and /sys/class/accel/*
    vfio       /dev/vfio/<N> groups (v5e, v5p, v6e VMs) -- counted only beside other evidence,
               as vfio also serves other passthrough devices
    env        TPU_ACCELERATOR_TYPE or TPU_WORKER_ID (set on TPU VMs by their image)

It also reads what decides whether the runtime can start here: transparent hugepages (JAX warns
unless ``[always]`` on v5e and newer: the runtime starts and stops slower), libtpu's lockfile
(``/tmp/libtpu_lockfile``, with its owner: one created by another user cannot be opened), and which
processes hold a chip's device node open (``/proc/<pid>/fd``; only processes this user may read).

Test hooks: ``PREHEAT_DEV_ROOT`` stands for ``/dev`` (as for the NVIDIA nodes), and
``PREHEAT_DOCTOR_HOST_ROOT`` for ``/`` when reading ``/sys``, ``/proc`` and ``/tmp``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device id -> chip generation (JAX's hardware_utils keeps the same table)
TPU_PCI_IDS = {
    "0x0027": "v3", "0x005e": "v4", "0x0062": "v5p", "0x0063": "v5e", "0x006f": "v6e", "0x0076": "tpu7x",
    "0x0083": "tpu8i", "0x007c": "tpu8t",
}
TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_TOPOLOGY", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_SKIP_MDS_QUERY",
           "TPU_NAME")
# TPU_ACCELERATOR_TYPE's prefix -> chip generation, where the PCI bus is not visible (a sandbox, a container)
_TYPE_GENERATION = (("v5litepod", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"), ("v6e", "v6e"), ("v4", "v4"), ("v3", "v3"))
_SIGNAL_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_ID")  # TPU_SKIP_MDS_QUERY is set by JAX itself off a TPU
LOCKFILE = "tmp/libtpu_lockfile"
THP = "sys/kernel/mm/transparent_hugepage/enabled"
_MAX_PIDS = 5000  # a bound on the /proc walk


@dataclass
class Holder:
    """A process that has a TPU device node open."""

    pid: int
    name: str
    node: str  # "/dev/accel0", "/dev/vfio/0"


@dataclass
class TpuHost:
    evidence: list[str] = field(default_factory=list)  # why this is a TPU VM; empty: it is not one
    pci_chips: int = 0
    generation: str | None = None  # "v5e", from the PCI device id
    accel_nodes: list[str] = field(default_factory=list)
    vfio_nodes: list[str] = field(default_factory=list)
    sys_accel: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    thp: str | None = None  # the bracketed choice: "always", "madvise", "never"; None: no such file
    lockfile: str | None = None  # its path when it exists
    lockfile_uid: int | None = None
    holders: list[Holder] = field(default_factory=list)

    @property
    def is_tpu(self) -> bool:
        return bool(self.evidence)

    @property
    def nodes(self) -> list[str]:
        return self.accel_nodes + self.vfio_nodes


def _host_root() -> Path:
    return Path(os.environ.get("PREHEAT_DOCTOR_HOST_ROOT", "/"))


def _dev_root() -> Path:
    return Path(os.environ.get("PREHEAT_DEV_ROOT", "/dev"))


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _pci(root: Path) -> tuple[int, str | None]:
    chips, generation = 0, None
    devices = root / "sys/bus/pci/devices"
    for name in _listdir(devices):
        if _read(devices / name / "vendor") != GOOGLE_PCI_VENDOR:
            continue
        gen = TPU_PCI_IDS.get(_read(devices / name / "device") or "")
        if gen is not None:
            chips, generation = chips + 1, gen
    return chips, generation


def _pci_id(generation: str | None) -> str:
    return next((k for k, v in TPU_PCI_IDS.items() if v == generation), "?")


def _holders(root: Path, dev: Path, own: set[int]) -> list[Holder]:
    """Processes with a chip's node open. A link names the real /dev path, whatever ``dev`` is."""
    pattern = re.compile(r"(?:^|/)(accel\d+|vfio/\d+)$")
    out: list[Holder] = []
    proc = root / "proc"
    for name in _listdir(proc)[:_MAX_PIDS]:
        if not name.isdigit() or int(name) in own:
            continue
        fd_dir = proc / name / "fd"
        for fd in _listdir(fd_dir):
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            m = pattern.search(target)
            if m and (target.startswith("/dev/") or target.startswith(str(dev))):
                out.append(Holder(int(name), _read(proc / name / "comm") or "?", f"/dev/{m.group(1)}"))
                break
    return out


def _tpu_host() -> TpuHost:
    root, dev = _host_root(), _dev_root()
    host = TpuHost()
    host.pci_chips, host.generation = _pci(root)
    host.accel_nodes = [f"/dev/{n}" for n in _listdir(dev) if re.fullmatch(r"accel\d+", n)]
    host.vfio_nodes = [f"/dev/vfio/{n}" for n in _listdir(dev / "vfio") if n.isdigit()]
    host.sys_accel = _listdir(root / "sys/class/accel")
    host.env = {k: os.environ[k] for k in TPU_ENV if os.environ.get(k)}
    if host.generation is None and host.env.get("TPU_ACCELERATOR_TYPE"):
        kind = host.env["TPU_ACCELERATOR_TYPE"].lower()
        host.generation = next((gen for prefix, gen in _TYPE_GENERATION if kind.startswith(prefix)), None)
    if host.pci_chips:
        host.evidence.append(f"PCI {GOOGLE_PCI_VENDOR}:{_pci_id(host.generation)}" + (f" x{host.pci_chips}" if host.pci_chips > 1 else ""))
    if host.accel_nodes:
        host.evidence.append(", ".join(host.accel_nodes))
    if host.sys_accel:
        host.evidence.append("/sys/class/accel/" + ",".join(host.sys_accel))
    signals = [k for k in _SIGNAL_ENV if k in host.env]
    if signals:
        host.evidence.append(", ".join(f"{k}={host.env[k]}" for k in signals))
    if host.evidence and host.vfio_nodes:
        host.evidence.append(", ".join(host.vfio_nodes))
    thp = _read(root / THP)
    m = re.search(r"\[(\w+)\]", thp or "")
    host.thp = m.group(1) if m else None
    lock = root / LOCKFILE
    try:
        host.lockfile_uid = lock.stat().st_uid
        host.lockfile = "/" + LOCKFILE
    except OSError:
        pass
    if host.is_tpu:
        host.holders = _holders(root, dev, {os.getpid()})
    return host
