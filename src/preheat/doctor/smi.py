"""Facts: ``nvidia-smi`` (GPUs, driver, compute processes) and the ``/dev/nvidia*`` device nodes."""

from __future__ import annotations

import csv
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from preheat.doctor.runner import _fmt_s, _run
from preheat.env import nvidia_device_nodes

@dataclass
class GPU:
    index: int
    name: str
    memory_mib: int | None
    driver: str | None
    compute_cap: tuple[int, int] | None


@dataclass
class ComputeApp:
    pid: int | None
    name: str
    used_mib: int | None


@dataclass
class SmiInfo:
    status: str  # "ok" | "missing" | "timeout" | "error"
    path: str | None = None
    gpus: list[GPU] = field(default_factory=list)
    driver: str | None = None
    cuda: str | None = None  # the highest CUDA version the driver supports (nvidia-smi header)
    error: str | None = None
    compute_cap_supported: bool = True
    apps: list[ComputeApp] | None = None  # None when the query failed
    apps_error: str | None = None

    @property
    def driver_major(self) -> int | None:
        driver = self.driver or next((g.driver for g in self.gpus if g.driver), None)
        if not driver:
            return None
        m = re.match(r"(\d+)", driver)
        return int(m.group(1)) if m else None

    @property
    def min_sm(self) -> tuple[int, int] | None:
        caps = [g.compute_cap for g in self.gpus if g.compute_cap]
        return min(caps) if caps else None


_QUERY_GPU = "--query-gpu=name,memory.total,driver_version,compute_cap"
_QUERY_GPU_NO_CC = "--query-gpu=name,memory.total,driver_version"
_QUERY_APPS = "--query-compute-apps=pid,process_name,used_memory"


def _na(value: str) -> str | None:
    value = value.strip()
    return None if not value or value.strip("[]").lower() in ("n/a", "not supported", "unknown error") else value


def _parse_mib(value: str) -> int | None:
    v = _na(value)
    if v is None:
        return None
    m = re.match(r"(\d+)", v)
    return int(m.group(1)) if m else None


def _parse_cc(value: str) -> tuple[int, int] | None:
    v = _na(value)
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _parse_gpu_csv(text: str, with_cc: bool) -> list[GPU]:
    gpus: list[GPU] = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if not row or not any(cell.strip() for cell in row):
            continue
        if len(row) < 3:
            raise ValueError(f"unexpected nvidia-smi --query-gpu line: {','.join(row)!r}")
        cc = _parse_cc(row[3]) if with_cc and len(row) > 3 else None
        gpus.append(GPU(len(gpus), row[0].strip(), _parse_mib(row[1]), _na(row[2]), cc))
    return gpus


def _parse_apps_csv(text: str) -> list[ComputeApp]:
    apps: list[ComputeApp] = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if not row or not any(cell.strip() for cell in row):
            continue
        if "no running" in ",".join(row).lower():
            continue
        pid_s = row[0].strip()
        pid = int(pid_s) if pid_s.isdigit() else None
        name = row[1].strip() if len(row) > 1 else ""
        used = _parse_mib(row[2]) if len(row) > 2 else None
        apps.append(ComputeApp(pid, name, used))
    return apps


def _query_nvidia_smi(timeout: float) -> SmiInfo:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return SmiInfo("missing")
    with ThreadPoolExecutor(max_workers=3) as pool:
        f_gpu = pool.submit(_run, [exe, _QUERY_GPU, "--format=csv,noheader"], timeout)
        f_hdr = pool.submit(_run, [exe], timeout)
        f_apps = pool.submit(_run, [exe, _QUERY_APPS, "--format=csv,noheader"], timeout)
        r_gpu, r_hdr, r_apps = f_gpu.result(), f_hdr.result(), f_apps.result()
    info = SmiInfo("ok", path=exe)
    with_cc = True
    if r_gpu.status == "error" and "compute_cap" in (r_gpu.stdout + r_gpu.stderr):
        # Drivers older than R510 do not know the compute_cap field.
        info.compute_cap_supported = with_cc = False
        r_gpu = _run([exe, _QUERY_GPU_NO_CC, "--format=csv,noheader"], timeout)
    if r_gpu.status == "timeout":
        info.status, info.error = "timeout", f"nvidia-smi did not answer within {_fmt_s(timeout)}"
    elif r_gpu.status != "ok":
        info.status = "error"
        info.error = r_gpu.first_line() or f"nvidia-smi exited with status {r_gpu.rc}"
    else:
        info.gpus = _parse_gpu_csv(r_gpu.stdout, with_cc)
    if r_hdr.status == "ok":
        m = re.search(r"Driver Version:\s*([0-9][0-9.]*)", r_hdr.stdout)
        info.driver = m.group(1) if m else None
        m = re.search(r"CUDA Version:\s*([0-9][0-9.]*)", r_hdr.stdout)
        info.cuda = m.group(1) if m else None
    if not info.driver and info.gpus:
        info.driver = info.gpus[0].driver
    if r_apps.status == "ok":
        info.apps = _parse_apps_csv(r_apps.stdout)
    else:
        info.apps_error = (
            f"did not answer within {_fmt_s(timeout)}" if r_apps.status == "timeout" else (r_apps.first_line() or "failed")
        )
    return info


def _dev_root() -> Path:
    return Path(os.environ.get("PREHEAT_DEV_ROOT", "/dev"))


def _dev_nodes() -> dict[str, list[str]]:
    root = _dev_root()
    names = nvidia_device_nodes()
    gpus = [n for n in names if re.fullmatch(r"nvidia\d+", n)]
    return {"root": [str(root)], "gpus": gpus, "all": names}
