"""Simulated machines for `preheat doctor`.

A ``machine`` is a temp folder with: a ``bin/`` that is the whole PATH (so a real nvidia-smi on the
test host is never found), a fake ``/dev`` root (``PREHEAT_DEV_ROOT``), fake Runpod mount points that
do not exist unless a test creates them, a private HOME, and fake JAX / torch probes (the documented
test hooks ``PREHEAT_DOCTOR_JAX_PROBE`` / ``PREHEAT_DOCTOR_TORCH_PROBE``). ``machine.gpu("a100_535")``
installs a fake ``nvidia-smi`` that replays the outputs recorded under ``fixtures/a100_535``:

    query-gpu-cc.out   nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
    query-gpu.out      the same without compute_cap (old drivers reject that field)
    query-compute-apps.out  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
    plain.out          plain `nvidia-smi` (its header carries the CUDA version)
    <name>.rc          exit status for that call (default 0)
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

FIXTURES = Path(__file__).resolve().parents[1] / "doctor" / "fixtures"  # the machines the doctor tests fake

_FAKE_SMI = r"""#!/bin/sh
D='{data}'
if [ -f "$D/HANG" ]; then
  /bin/sleep 60   # not exec: a grandchild holds the pipes, as a hung driver call would
  exit 0
fi
case "$*" in
  *--query-gpu=*compute_cap*) k=query-gpu-cc ;;
  *--query-gpu=*) k=query-gpu ;;
  *--query-compute-apps=*) k=query-compute-apps ;;
  "") k=plain ;;
  *) echo "fake nvidia-smi: unexpected arguments: $*"; exit 2 ;;
esac
case "$*" in
  *--query-*) case "$*" in *--format=csv,noheader*) ;; *) echo "fake nvidia-smi: expected --format=csv,noheader"; exit 2 ;; esac ;;
esac
[ -f "$D/$k.out" ] && /bin/cat "$D/$k.out"
rc=0
[ -f "$D/$k.rc" ] && rc=$(/bin/cat "$D/$k.rc")
exit $rc
"""

_CLEAR = (
    "PREHEAT_HOME",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "LD_LIBRARY_PATH",
    "JAX_PLATFORMS",
    "XLA_FLAGS",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
    "RUNPOD_POD_ID",
    "RUNPOD_ENDPOINT_ID",
    "PREHEAT_DOCTOR_TIMEOUT",
    "COLUMNS",
    "TPU_ACCELERATOR_TYPE",
    "TPU_TOPOLOGY",
    "TPU_WORKER_ID",
    "TPU_WORKER_HOSTNAMES",
    "TPU_SKIP_MDS_QUERY",
    "TPU_NAME",
    "TPU_LIBRARY_PATH",
)


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def probe_script(path: Path, data: dict | None, *, rc: int = 0, stderr: str = "", sleep: float | None = None) -> Path:
    """A fake probe: prints what the real probe prints (``PREHEAT_DOCTOR_PROBE=<json>``)."""
    lines = ["#!/bin/sh"]
    if sleep:
        lines.append(f"/bin/sleep {sleep}")
    if stderr:
        lines.append("/bin/cat >&2 <<'PREHEAT_EOF'\n" + stderr + "\nPREHEAT_EOF")
    if data is not None:
        lines.append("/bin/cat <<'PREHEAT_EOF'\nPREHEAT_DOCTOR_PROBE=" + json.dumps(data) + "\nPREHEAT_EOF")
    if rc < 0:
        lines.append(f"kill -{-rc} $$")
    lines.append(f"exit {max(rc, 0)}")
    return _executable(path, "\n".join(lines) + "\n")


JAX_CPU = {"ok": True, "jax_version": "0.10.2", "backend": "cpu", "devices": ["cpu"], "device_count": 1, "result_ok": True, "backend_errors": {}, "warnings": [], "elapsed_s": 0.4}
TORCH_CPU = {"ok": True, "version": "2.13.0+cpu", "cuda_build": None, "hip_build": None, "cuda_available": False, "warnings": [], "elapsed_s": 0.5}


def jax_gpu(kind: str, n: int = 1) -> dict:
    return {**JAX_CPU, "backend": "gpu", "devices": [kind] * n, "device_count": n, "elapsed_s": 2.3}


class Machine:
    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root, self.mp = root, monkeypatch
        self.bin = root / "bin"
        self.dev = root / "dev"
        self.home = root / "home"
        self.workspace = root / "workspace"
        self.runpod_volume = root / "runpod-volume"
        self.host = root / "host"  # stands for / when doctor reads /sys, /proc and /tmp (a TPU VM's facts)
        for d in (self.bin, self.dev, self.home, self.host):
            d.mkdir(parents=True)
        for var in _CLEAR:
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("PATH", str(self.bin))
        monkeypatch.setenv("HOME", str(self.home))
        monkeypatch.setenv("PREHEAT_DEV_ROOT", str(self.dev))
        monkeypatch.setenv("PREHEAT_DOCTOR_HOST_ROOT", str(self.host))
        monkeypatch.setenv("PREHEAT_WORKSPACE", str(self.workspace))
        monkeypatch.setenv("PREHEAT_RUNPOD_VOLUME", str(self.runpod_volume))
        self.jax(JAX_CPU)
        self.torch(TORCH_CPU)
        _hide_host_gpu_plugins(monkeypatch)

    # -- hardware ---------------------------------------------------------------------------
    def gpu(self, fixture: str, *, dev_nodes: bool = True, hang: bool = False) -> Path:
        data = self.root / "smi" / fixture
        shutil.copytree(FIXTURES / fixture, data)
        if hang:
            (data / "HANG").write_text("")
        _executable(self.bin / "nvidia-smi", _FAKE_SMI.replace("{data}", str(data)))
        if dev_nodes:
            self.dev_nodes()
        return data

    def tpu(self, *, versions: dict[str, str | None] | None = None, thp: str | None = None, env: bool = True,
            jax: dict | None = None, pci: bool = False) -> None:
        """A TPU v5e VM (tests/_support/tpu_fixtures.py): its PCI ids, /dev/vfio, TPU_* variables,
        hugepages setting, the JAX probe's answer and the installed jax / jaxlib / libtpu
        (``versions``: a name -> None hides it). ``pci``: a full VM's PCI ids (the recorded sandbox
        shows none); ``thp``: a hugepages setting (the recorded sandbox has no such file)."""
        from preheat.doctor import dists
        from tests._support import tpu_fixtures as f

        for slot, (vendor, device) in (f.PCI if pci else {}).items():
            pci = self.host / "sys/bus/pci/devices" / slot
            pci.mkdir(parents=True)
            (pci / "vendor").write_text(vendor + "\n")
            (pci / "device").write_text(device + "\n")
        for node in f.HOST["dev"]:
            (self.dev / node).parent.mkdir(parents=True, exist_ok=True)
            (self.dev / node).write_text("")
        if env:
            for k, v in f.HOST["env"].items():
                self.mp.setenv(k, v)
        if thp is not None:
            thp_file = self.host / "sys/kernel/mm/transparent_hugepage/enabled"
            thp_file.parent.mkdir(parents=True)
            thp_file.write_text(thp + "\n")
        self.jax(f.JAX_TPU if jax is None else jax)
        table = {**f.VERSIONS, **(versions or {})}
        real = dists._dist_version
        self.mp.setattr(dists, "_dist_version", lambda name: table[name] if name in table else real(name))

    def holder(self, pid: int, name: str, node: str = "/dev/vfio/0") -> None:
        """A process (in the fake /proc) that has a TPU node open."""
        fd = self.host / "proc" / str(pid) / "fd"
        fd.mkdir(parents=True)
        (fd / "7").symlink_to(node)
        (self.host / "proc" / str(pid) / "comm").write_text(name + "\n")

    def lockfile(self) -> None:
        (self.host / "tmp").mkdir(exist_ok=True)
        (self.host / "tmp" / "libtpu_lockfile").write_text("")

    def dev_nodes(self, n: int = 1) -> None:
        for name in [f"nvidia{i}" for i in range(n)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]:
            (self.dev / name).write_text("")

    # -- software ---------------------------------------------------------------------------
    def jax(self, data: dict | None, **kw) -> None:
        self.mp.setenv("PREHEAT_DOCTOR_JAX_PROBE", str(probe_script(self.root / "jax-probe.sh", data, **kw)))

    def torch(self, data: dict | None, **kw) -> None:
        self.mp.setenv("PREHEAT_DOCTOR_TORCH_PROBE", str(probe_script(self.root / "torch-probe.sh", data, **kw)))

    def real_jax(self) -> None:
        self.mp.delenv("PREHEAT_DOCTOR_JAX_PROBE", raising=False)

    def real_torch(self) -> None:
        self.mp.delenv("PREHEAT_DOCTOR_TORCH_PROBE", raising=False)

    # -- running ----------------------------------------------------------------------------
    def run(self, *args: str):
        """Run `preheat doctor ARGS --json` in-process; returns (exit_code, parsed JSON)."""
        from preheat.cli import main

        result = CliRunner().invoke(main, ["doctor", "--json", *args], catch_exceptions=False)
        return result.exit_code, json.loads(result.stdout)

    def human(self, *args: str):
        from preheat.cli import main

        result = CliRunner(env={"COLUMNS": "250"}).invoke(main, ["doctor", *args], catch_exceptions=False)
        return result.exit_code, result.stdout


def _hide_host_gpu_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulated machine has the JAX GPU plugins and NVIDIA library wheels its test installs
    (a fake site), never the test host's own: the test-gpu extra brings jax-cuda13-plugin for `warm
    --target`'s deviceless compiles, and on Python 3.12 torch's CUDA build brings nvidia-cudnn /
    -cublas wheels; a doctor test must not see them, as it never sees the host's nvidia-smi."""
    import sysconfig

    from preheat.doctor import dists
    from preheat.doctor.checks import cuda_libs

    host_sites = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    real = dists._distributions

    def simulated() -> dict:
        return {name: d for name, d in real().items()
                if not ((dists._JAX_GPU_PLUGIN_RE.match(name) or name.startswith("nvidia-"))
                        and Path(d.locate_file("")).resolve() in host_sites)}

    monkeypatch.setattr(dists, "_distributions", simulated)
    monkeypatch.setattr(cuda_libs, "_distributions", simulated)


def check(report: dict, check_id: str) -> dict:
    for c in report["checks"]:
        if c["id"] == check_id:
            return c
    raise AssertionError(f"no check {check_id!r} in {[c['id'] for c in report['checks']]}")
