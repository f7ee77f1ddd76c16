"""`preheat doctor`: name what is wrong with a GPU pod's setup, and the exact fix.

``jax.print_environment_info()`` and ``torch.utils.collect_env`` print facts; this module turns the
facts into findings. ``run_checks()`` returns a ``Report`` (a list of ``CheckResult``: status
``ok``/``warn``/``fail``, a one-line finding, and when not ok the command or setting that fixes it);
``doctor_command`` is the thin click front end (a rich table, or one JSON object with ``--json``).

How it is kept safe:

* Nothing here imports JAX or torch. Both are probed in a fresh subprocess (``python -c ...``) with
  a timeout and in its own process group, so a hanging or crashing CUDA plugin cannot hang or kill
  doctor, and XLA/JAX environment variables are read exactly as a new program would read them.
* ``nvidia-smi`` runs under the same timeout. A hung driver shows up as a finding, not a hang.
* Every check runs even when another raises; a check that raises is reported as ``fail`` with its
  error. The command itself never prints a traceback.

Environment variables read by doctor itself:

``PREHEAT_DEV_ROOT``        where to look for ``nvidia*`` device nodes (default ``/dev``).
``PREHEAT_DOCTOR_TIMEOUT``  seconds allowed to each external command (nvidia-smi and the JAX /
                            torch probes). Default: 5 s for nvidia-smi, 20 s for the probes (a
                            first JAX import on a GPU can legitimately take several seconds).

Test hooks (used only by tests/doctor; never needed in normal use):

``PREHEAT_DOCTOR_JAX_PROBE``    a command run instead of the built-in JAX probe. It must print one
                                line ``PREHEAT_DOCTOR_PROBE=<json>`` shaped like ``_JAX_PROBE_SRC``'s.
``PREHEAT_DOCTOR_TORCH_PROBE``  the same for the torch probe (``_TORCH_PROBE_SRC``).

When a probe hook is set the probe runs even if the package is not installed.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import click

__all__ = [
    "OK",
    "WARN",
    "FAIL",
    "CheckResult",
    "Report",
    "run_checks",
    "doctor_command",
]

OK, WARN, FAIL = "ok", "warn", "fail"
_STATUS_ORDER = {OK: 0, WARN: 1, FAIL: 2}

# The driver decides which JAX CUDA build can run (JAX installation docs).
DRIVER_MIN_CUDA13 = 580
DRIVER_MIN_CUDA12 = 525
# Oldest GPU architecture each build supports (SM = compute capability).
SM_MIN = {"cuda13": (7, 5), "cuda12": (5, 2)}
# Warn when a cache filesystem has less than this free.
MIN_FREE_GIB = 5.0

DEFAULT_SMI_TIMEOUT_S = 5.0
DEFAULT_PROBE_TIMEOUT_S = 20.0
PROBE_MARK = "PREHEAT_DOCTOR_PROBE="
_GPU_BACKENDS = ("gpu", "cuda", "rocm")
_JAX_GPU_PLUGIN_RE = re.compile(r"^(jax-cuda\d+-(plugin|pjrt)|jax-rocm\d+-(plugin|pjrt)|libtpu)$")
_NVIDIA_FAMILY_RE = re.compile(r"^nvidia-(cudnn|cublas)(?:-cu(\d+))?$")
_CUDA_LIB_FILE_RE = re.compile(r"^lib(cudnn|cublas|cublasLt|cudart|cufft|cusparse|cusolver|nccl|nvrtc|nvJitLink)\b.*\.so")
_TORCH_INDEX = "https://download.pytorch.org/whl"


# ----------------------------------------------------------------------------------------------
# Results


@dataclass
class CheckResult:
    """One check: ``status`` is ok/warn/fail; ``fix`` is set whenever status is not ok."""

    id: str
    title: str
    status: str
    finding: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "status": self.status,
            "finding": self.finding,
            "fix": self.fix,
            "details": self.details,
        }


@dataclass
class Report:
    checks: list[CheckResult]
    versions: dict[str, Any]
    require_gpu: bool = False
    gpu_backend: bool | None = None  # True when JAX computed on a GPU; None when unknown
    elapsed_s: float = 0.0

    @property
    def summary(self) -> dict[str, int]:
        counts = {OK: 0, WARN: 0, FAIL: 0}
        for c in self.checks:
            counts[c.status] = counts.get(c.status, 0) + 1
        return counts

    @property
    def exit_code(self) -> int:
        if any(c.status == FAIL for c in self.checks):
            return 1
        if self.require_gpu and self.gpu_backend is not True:
            return 1
        return 0

    def check(self, check_id: str) -> CheckResult:
        for c in self.checks:
            if c.id == check_id:
                return c
        raise KeyError(check_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.exit_code == 0,
            "exit_code": self.exit_code,
            "require_gpu": self.require_gpu,
            "gpu_backend": self.gpu_backend,
            "summary": self.summary,
            "checks": [c.to_dict() for c in self.checks],
            "versions": self.versions,
            "elapsed_s": round(self.elapsed_s, 2),
        }


# ----------------------------------------------------------------------------------------------
# Running external commands without ever hanging


@dataclass
class CmdResult:
    status: str  # "ok" | "missing" | "timeout" | "error" (non-zero exit or could not start)
    rc: int | None = None
    stdout: str = ""
    stderr: str = ""
    elapsed_s: float = 0.0

    def first_line(self) -> str:
        """The first non-empty output line (nvidia-smi prints its errors on stdout)."""
        for text in (self.stdout, self.stderr):
            for line in text.splitlines():
                if line.strip():
                    return line.strip()
        return ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        try:
            proc.kill()
        except OSError:
            pass


def _run(argv: Sequence[str], timeout: float) -> CmdResult:
    """Run ``argv`` in its own process group; on timeout kill the whole group (children too)."""
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
    except FileNotFoundError:
        return CmdResult("missing", elapsed_s=time.monotonic() - t0)
    except OSError as exc:
        return CmdResult("error", stderr=f"cannot run {argv[0]}: {exc}", elapsed_s=time.monotonic() - t0)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=2)
        except subprocess.TimeoutExpired:  # something outside the group still holds the pipes
            out, err = "", ""
            for stream in (proc.stdout, proc.stderr):
                try:
                    stream.close()  # type: ignore[union-attr]
                except OSError:
                    pass
        return CmdResult("timeout", None, out or "", err or "", time.monotonic() - t0)
    except BaseException:  # Ctrl-C: the group is in its own session, so take it down ourselves
        _kill_group(proc)
        raise
    status = "ok" if proc.returncode == 0 else "error"
    return CmdResult(status, proc.returncode, out, err, time.monotonic() - t0)


def _timeouts() -> tuple[float, float]:
    """(nvidia-smi timeout, probe timeout) in seconds."""
    raw = os.environ.get("PREHEAT_DOCTOR_TIMEOUT", "").strip()
    if raw:
        try:
            value = float(raw)
            if value > 0:
                return value, value
        except ValueError:
            pass
    return DEFAULT_SMI_TIMEOUT_S, DEFAULT_PROBE_TIMEOUT_S


def _fmt_s(seconds: float) -> str:
    return f"{seconds:g} s"


# ----------------------------------------------------------------------------------------------
# Facts: nvidia-smi and /dev


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
    try:
        names = sorted(p.name for p in root.iterdir() if p.name.startswith("nvidia"))
    except OSError:
        names = []
    gpus = [n for n in names if re.fullmatch(r"nvidia\d+", n)]
    return {"root": [str(root)], "gpus": gpus, "all": names}


# ----------------------------------------------------------------------------------------------
# Facts: the JAX and torch probes (run in a subprocess)

_JAX_PROBE_SRC = r"""
import json, logging, sys, time, warnings
out = {"ok": False}
records = []
class _H(logging.Handler):
    def emit(self, record):
        try:
            records.append(record.getMessage())
        except Exception:
            pass
logging.getLogger("jax").addHandler(_H(level=logging.WARNING))
t0 = time.perf_counter()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        import jax, jax.numpy as jnp
        out["jax_version"] = jax.__version__
        x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 64.0
        value = float(jax.jit(lambda a: (a @ a.T).sum())(x))
        ref = [[(r * 8 + c) / 64.0 for c in range(8)] for r in range(8)]
        expected = sum(sum(a * b for a, b in zip(ref[i], ref[k])) for i in range(8) for k in range(8))
        out["result_ok"] = abs(value - expected) <= 1e-3 * abs(expected)
        out["backend"] = jax.default_backend()
        devices = jax.devices()
        out["device_count"] = len(devices)
        out["devices"] = [getattr(d, "device_kind", str(d)) for d in devices]
        out["ok"] = True
    except BaseException as exc:
        out["error"] = "%s: %s" % (type(exc).__name__, exc)
try:
    from jax._src import xla_bridge as _xb
    out["backend_errors"] = {k: str(v) for k, v in getattr(_xb, "_backend_errors", {}).items()}
except BaseException:
    pass
out["warnings"] = [m for m in records if m][:20] + [str(w.message) for w in caught][:10]
out["elapsed_s"] = round(time.perf_counter() - t0, 3)
sys.stdout.write("PREHEAT_DOCTOR_PROBE=" + json.dumps(out) + "\n")
"""

_TORCH_PROBE_SRC = r"""
import json, sys, time, warnings
out = {"ok": False}
t0 = time.perf_counter()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        import torch
        out["version"] = torch.__version__
        out["cuda_build"] = torch.version.cuda
        out["hip_build"] = getattr(torch.version, "hip", None)
        out["cuda_available"] = bool(torch.cuda.is_available())
        if out["cuda_available"]:
            n = torch.cuda.device_count()
            out["device_count"] = n
            out["devices"] = [torch.cuda.get_device_name(i) for i in range(n)]
            out["capabilities"] = [list(torch.cuda.get_device_capability(i)) for i in range(n)]
            out["arch_list"] = list(torch.cuda.get_arch_list())
            try:
                x = torch.ones(8, 8, device="cuda")
                out["result_ok"] = float((x @ x).sum()) == 512.0
            except BaseException as exc:
                out["compute_error"] = "%s: %s" % (type(exc).__name__, exc)
        out["ok"] = True
    except BaseException as exc:
        out["error"] = "%s: %s" % (type(exc).__name__, exc)
out["warnings"] = [str(w.message).strip() for w in caught if str(w.message).strip()][:10]
out["elapsed_s"] = round(time.perf_counter() - t0, 3)
sys.stdout.write("PREHEAT_DOCTOR_PROBE=" + json.dumps(out) + "\n")
"""


@dataclass
class ProbeResult:
    status: str  # "ok" (JSON received) | "timeout" | "crashed" | "skipped"
    data: dict[str, Any] = field(default_factory=dict)
    stderr: str = ""
    rc: int | None = None
    elapsed_s: float = 0.0
    timeout_s: float = 0.0


def _run_probe(hook_var: str, src: str, timeout: float) -> ProbeResult:
    hook = os.environ.get(hook_var, "").strip()
    argv = shlex.split(hook) if hook else [sys.executable, "-c", src]
    r = _run(argv, timeout)
    if r.status == "timeout":
        return ProbeResult("timeout", stderr=r.stderr, elapsed_s=r.elapsed_s, timeout_s=timeout)
    data = None
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(PROBE_MARK):
            try:
                data = json.loads(line[len(PROBE_MARK):])
            except ValueError:
                data = None
            break
    if not isinstance(data, dict):
        return ProbeResult("crashed", stderr=r.stderr or r.stdout, rc=r.rc, elapsed_s=r.elapsed_s, timeout_s=timeout)
    return ProbeResult("ok", data, r.stderr, r.rc, r.elapsed_s, timeout)


def _signal_name(rc: int | None) -> str:
    if rc is not None and rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


_RELEVANT_RE = re.compile(
    r"(error|fail|unable|cannot|could not|not found|insufficient|mismatch|incompatible|undefined symbol|CUDA|cuDNN|cublas)",
    re.IGNORECASE,
)


def _first_relevant_line(*texts: str) -> str:
    """The first line that reads like an error, else the first non-empty line (trimmed)."""
    lines = [ln.strip() for t in texts if t for ln in t.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("Traceback", "File \"", "^"))]
    pick = next((ln for ln in lines if _RELEVANT_RE.search(ln)), lines[0] if lines else "")
    return pick if len(pick) <= 400 else pick[:397] + "..."


# ----------------------------------------------------------------------------------------------
# Facts: installed distributions


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist_search_path() -> list[str]:
    """Where installed distributions are looked up (tests add a fake site-packages here)."""
    return list(sys.path)


def _distributions() -> dict[str, metadata.Distribution]:
    seen: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions(path=_dist_search_path()):
        try:
            name = dist.metadata["Name"]
        except Exception:
            continue
        if name and _norm(name) not in seen:
            seen[_norm(name)] = dist
    return seen


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
    except Exception:
        return None


def _jax_gpu_plugins() -> dict[str, str]:
    out: dict[str, str] = {}
    for name, dist in _distributions().items():
        if _JAX_GPU_PLUGIN_RE.match(name):
            out[name] = dist.version
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------------------------
# The context shared by checks: facts gathered once, errors kept per fact


class _FactError(Exception):
    pass


class Context:
    """Facts for the checks. A fact whose gathering raised re-raises when a check reads it."""

    def __init__(self, require_gpu: bool = False) -> None:
        self.require_gpu = require_gpu
        self.smi_timeout, self.probe_timeout = _timeouts()
        self._facts: dict[str, Any] = {}
        self._errors: dict[str, BaseException] = {}
        self.gpu_backend: bool | None = None

    def gather(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            self._facts[name] = fn()
        except Exception as exc:  # a fact that cannot be gathered fails the checks that read it
            self._errors[name] = exc

    def fact(self, name: str) -> Any:
        if name in self._errors:
            exc = self._errors[name]
            raise _FactError(f"gathering {name} failed: {type(exc).__name__}: {exc}") from exc
        return self._facts[name]

    # -- derived facts --------------------------------------------------------------------------

    @property
    def smi(self) -> SmiInfo:
        return self.fact("smi")

    @property
    def dev(self) -> dict[str, list[str]]:
        return self.fact("dev")

    def gpu_present(self) -> bool:
        smi_gpus = False
        try:
            smi_gpus = self.smi.status == "ok" and bool(self.smi.gpus)
        except _FactError:
            pass
        return smi_gpus or bool(self.dev["gpus"])

    def plan(self) -> dict[str, Any]:
        """Which JAX build fits this driver and GPU: {"build": "cuda13"|"cuda12"|None, "why": ...}."""
        smi = self.smi
        if smi.status != "ok":
            return {"build": None, "why": "driver unknown", "driver_major": None, "min_sm": None}
        major, sm = smi.driver_major, smi.min_sm
        plan: dict[str, Any] = {"driver_major": major, "min_sm": sm}
        if major is None:
            plan.update(build=None, why="driver unknown")
        elif major < DRIVER_MIN_CUDA12:
            plan.update(build=None, why="driver too old")
        elif sm is not None and sm < SM_MIN["cuda12"]:
            plan.update(build=None, why="gpu too old")
        elif major >= DRIVER_MIN_CUDA13 and (sm is None or sm >= SM_MIN["cuda13"]):
            plan.update(build="cuda13", why="driver >= 580")
        elif major >= DRIVER_MIN_CUDA13:
            plan.update(build="cuda12", why="gpu too old for cuda13")
        else:
            plan.update(build="cuda12", why="driver >= 525")
        return plan


def _sm(cc: tuple[int, int] | None) -> str:
    return f"{cc[0]}.{cc[1]}" if cc else "unknown"


def _pip_jax(build: str) -> str:
    return f'pip install -U "jax[{build}]"'


_DRIVER_FIX = (
    f"upgrade the NVIDIA driver to >= {DRIVER_MIN_CUDA13} (>= {DRIVER_MIN_CUDA12} for jax[cuda12]); a rented pod cannot "
    "change its driver: redeploy on a host whose CUDA version is >= 12.0 (>= 13.0 for jax[cuda13]) with the provider's "
    "CUDA-version filter"
)


# ----------------------------------------------------------------------------------------------
# Check 1: accelerator


def _check_accelerator(ctx: Context) -> CheckResult:
    title = "Accelerator"
    dev, smi = ctx.dev, ctx.smi
    details: dict[str, Any] = {
        "dev_root": dev["root"][0],
        "dev_nodes": dev["all"],
        "nvidia_smi": smi.path,
        "nvidia_smi_status": smi.status,
        "driver": smi.driver,
        "cuda_driver_supports": smi.cuda,
        "gpus": [
            {"index": g.index, "name": g.name, "memory_mib": g.memory_mib, "compute_cap": _sm(g.compute_cap) if g.compute_cap else None}
            for g in smi.gpus
        ],
    }

    def res(status: str, finding: str, fix: str | None = None) -> CheckResult:
        return CheckResult("accelerator", title, status, finding, fix, details)

    nodes = dev["gpus"]
    if smi.status == "missing":
        if not nodes:
            return res(OK, f"no NVIDIA GPU: no {dev['root'][0]}/nvidia* device nodes and no nvidia-smi on PATH; JAX and torch run on CPU")
        return res(
            WARN,
            f"{len(nodes)} GPU device node(s) ({', '.join(nodes)}) but nvidia-smi is not on PATH: cannot read the driver version",
            "start the container with the NVIDIA runtime's utility capability (docker run --gpus all, or "
            "NVIDIA_DRIVER_CAPABILITIES=compute,utility), or add nvidia-smi's folder to PATH",
        )
    if smi.status == "timeout":
        return res(
            FAIL,
            f"nvidia-smi did not answer within {_fmt_s(ctx.smi_timeout)}: the driver or GPU is hung",
            "restart the pod; if nvidia-smi still hangs the host GPU is faulty: move to another machine",
        )
    if smi.status == "error":
        if not nodes:
            return res(
                WARN,
                f"nvidia-smi is installed but fails ({smi.error}) and there are no {dev['root'][0]}/nvidia* device nodes: "
                "no GPU is visible in this container",
                "if this pod should have a GPU, redeploy it with a GPU (docker run --gpus all); otherwise ignore",
            )
        return res(
            FAIL,
            f"nvidia-smi fails: {smi.error}",
            "restart the pod; if it persists the host's driver is broken: redeploy on another machine",
        )
    if not smi.gpus:
        return res(WARN, "nvidia-smi runs but lists no GPUs", "redeploy the pod with a GPU attached (docker run --gpus all)")

    counts: dict[str, int] = {}
    for g in smi.gpus:
        counts[g.name] = counts.get(g.name, 0) + 1
    g0 = smi.gpus[0]
    mem = f"{g0.memory_mib} MiB" if g0.memory_mib is not None else "memory unknown"
    sm = smi.min_sm
    sm_text = f"SM {_sm(sm)}" if sm else ("SM unknown: this nvidia-smi has no compute_cap field" if not smi.compute_cap_supported else "SM unknown")
    gpus_text = ", ".join(f"{n}x {name}" for name, n in counts.items())
    cuda = f" (supports CUDA <= {smi.cuda})" if smi.cuda else ""
    base = f"{gpus_text} ({mem}, {sm_text}); driver {smi.driver or 'unknown'}{cuda}"
    plan = ctx.plan()
    details["recommended_jax"] = f"jax[{plan['build']}]" if plan["build"] else None

    if not nodes:
        return res(
            WARN,
            f"{base}; but no {dev['root'][0]}/nvidia[0-9]* device nodes: CUDA programs cannot open the GPU",
            "redeploy/restart the container with the GPU attached (docker run --gpus all)",
        )
    if plan["why"] == "driver unknown":
        return res(WARN, f"{base}; cannot tell which JAX build fits", "check the driver with `nvidia-smi`; jax[cuda12] needs >= 525, jax[cuda13] >= 580")
    if plan["why"] == "driver too old":
        return res(
            FAIL,
            f"{base}: driver {plan['driver_major']} is too old for any JAX GPU build "
            f"(jax[cuda12] needs >= {DRIVER_MIN_CUDA12}, jax[cuda13] needs >= {DRIVER_MIN_CUDA13})",
            _DRIVER_FIX,
        )
    if plan["why"] == "gpu too old":
        return res(
            FAIL,
            f"{base}: no JAX GPU build supports SM {_sm(sm)} (CUDA 12 builds need SM >= 5.2, CUDA 13 builds SM >= 7.5)",
            "use a newer GPU (SM >= 7.5 runs both builds)",
        )
    if plan["why"] == "gpu too old for cuda13":
        return res(
            WARN,
            f"{base}: the driver allows jax[cuda13] but CUDA 13 builds need SM >= 7.5; this GPU (SM {_sm(sm)}) needs jax[cuda12] "
            "(CUDA 12 builds support SM >= 5.2)",
            _pip_jax("cuda12"),
        )
    if plan["build"] == "cuda13":
        return res(OK, f"{base} -> use jax[cuda13] (CUDA 13 builds support SM >= 7.5; jax[cuda12] also runs on this driver)")
    return res(OK, f"{base} -> use jax[cuda12] (CUDA 12 builds support SM >= 5.2; jax[cuda13] needs driver >= {DRIVER_MIN_CUDA13})")


# ----------------------------------------------------------------------------------------------
# Check 2: JAX backend


def _jax_fix(ctx: Context, plugins: dict[str, str]) -> str:
    """The exact command that gets JAX onto this GPU."""
    jp = os.environ.get("JAX_PLATFORMS", "").strip()
    if jp and not any(p.strip() in ("cuda", "gpu") for p in jp.split(",")):
        return f"unset JAX_PLATFORMS (it is {jp!r}, which keeps JAX off the GPU)"
    try:
        plan = ctx.plan()
    except _FactError:
        plan = {"build": None, "why": "driver unknown"}
    build = plan["build"]
    if build is None:
        if plan["why"] == "driver too old":
            return _DRIVER_FIX
        if plan["why"] == "gpu too old":
            return "use a newer GPU (SM >= 5.2 for jax[cuda12], SM >= 7.5 for jax[cuda13])"
        return f'{_pip_jax("cuda12")} (driver >= {DRIVER_MIN_CUDA12}) or {_pip_jax("cuda13")} (driver >= {DRIVER_MIN_CUDA13})'
    wrong = sorted(p for p in plugins if re.match(r"jax-(cuda\d+|rocm\d+)-", p) and not p.startswith(f"jax-{build}-"))
    cmd = _pip_jax(build)
    if wrong:
        cmd = f"pip uninstall -y {' '.join(wrong)} && {cmd}"
    return cmd


def _check_jax(ctx: Context) -> CheckResult:
    title = "JAX backend"
    jax_v, jaxlib_v = _dist_version("jax"), _dist_version("jaxlib")
    plugins = _jax_gpu_plugins()
    details: dict[str, Any] = {"jax": jax_v, "jaxlib": jaxlib_v, "plugins": plugins, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS")}
    gpu = ctx.gpu_present()
    probe: ProbeResult = ctx.fact("jax_probe")
    details["probe"] = {"status": probe.status, "elapsed_s": round(probe.elapsed_s, 2), **probe.data}

    def res(status: str, finding: str, fix: str | None = None) -> CheckResult:
        return CheckResult("jax", title, status, finding, fix, details)

    plugin_text = ", ".join(f"{k} {v}" for k, v in plugins.items()) or "no GPU plugin"
    versions = f"jax {jax_v or '?'} / jaxlib {jaxlib_v or '?'} + {plugin_text}"
    mismatched = [k for k, v in plugins.items() if k.startswith("jax-cuda") and jaxlib_v and v != jaxlib_v]

    if probe.status == "skipped":
        ctx.gpu_backend = False
        return res(FAIL, "jax is not installed", _jax_fix(ctx, plugins) if gpu else 'pip install -U "jax"')
    if probe.status == "timeout":
        return res(
            FAIL,
            f"{versions}: `import jax` + a tiny computation did not finish within {_fmt_s(probe.timeout_s)} "
            "(a CUDA plugin hanging at initialisation?)",
            'run `python -c "import jax; print(jax.devices())"` to see it hang; if it does: '
            + (_jax_fix(ctx, plugins) if gpu else 'pip install -U --force-reinstall "jax"')
            + "; if JAX is just slow here rerun with PREHEAT_DOCTOR_TIMEOUT=60",
        )
    if probe.status == "crashed":
        line = _first_relevant_line(probe.stderr)
        return res(
            FAIL,
            f"{versions}: the JAX probe process died ({_signal_name(probe.rc)}): {line or 'no output'}",
            _jax_fix(ctx, plugins) if gpu else 'pip install -U --force-reinstall "jax" "jaxlib"',
        )
    data = probe.data
    if not data.get("ok"):
        err = data.get("error") or "unknown error"
        line = _first_relevant_line(err)
        extra = f" (plugin versions {', '.join(mismatched)} differ from jaxlib {jaxlib_v})" if mismatched else ""
        ctx.gpu_backend = False
        return res(FAIL, f"{versions}: JAX fails to start: {line}{extra}", _jax_fix(ctx, plugins))

    backend = str(data.get("backend") or "unknown")
    devices = data.get("devices") or []
    dev_text = ", ".join(f"{n}x {k}" for k, n in _count(devices).items()) or "no devices"
    details["backend"] = backend
    on_gpu = backend in _GPU_BACKENDS
    ctx.gpu_backend = on_gpu
    if data.get("result_ok") is False:
        return res(
            FAIL,
            f"{versions}: backend {backend} ({dev_text}) computed a WRONG result for an 8x8 matmul",
            _jax_fix(ctx, plugins) if on_gpu else 'pip install -U --force-reinstall "jax" "jaxlib"',
        )
    timing = f" (import + test matmul in {probe.data.get('elapsed_s', probe.elapsed_s):.1f} s)"
    if on_gpu:
        note = ""
        try:
            plan = ctx.plan()
            if plan["build"] == "cuda13" and "jax-cuda13-plugin" not in plugins and "jax-cuda12-plugin" in plugins:
                note = "; jax[cuda13] would also run on this driver"
        except _FactError:
            pass
        return res(OK, f"{versions}: backend {backend}, {dev_text}{timing}{note}")
    if gpu:
        cuda_err = (data.get("backend_errors") or {}).get("cuda")
        warn_lines = [w for w in data.get("warnings") or [] if re.search(r"cuda|gpu|plugin", w, re.IGNORECASE)]
        jp = os.environ.get("JAX_PLATFORMS", "").strip()
        if jp and not any(p.strip() in ("cuda", "gpu") for p in jp.split(",")):
            why = f"JAX_PLATFORMS={jp} keeps JAX off the GPU"
        elif cuda_err or any("failed to initialize" in w or "Unable to initialize" in w for w in warn_lines):
            why = "the CUDA plugin failed to initialise: " + _first_relevant_line(cuda_err or "", *warn_lines)
        elif not any(k.startswith("jax-cuda") for k in plugins) and "+cuda" not in (jaxlib_v or ""):
            why = "jaxlib is CPU-only (no jax-cuda plugin installed)"
        else:
            what = "the CUDA plugin" if plugins else f"the CUDA jaxlib ({jaxlib_v})"
            why = f"{what} is installed but not used" + (": " + _first_relevant_line(*warn_lines) if warn_lines else "")
        if mismatched:
            why += f" (plugin versions {', '.join(mismatched)} differ from jaxlib {jaxlib_v})"
        return res(FAIL, f"{versions}: JAX runs on {backend} although an NVIDIA GPU is present: {why}", _jax_fix(ctx, plugins))
    if ctx.require_gpu:
        return res(
            FAIL,
            f"{versions}: backend {backend} and no GPU on this machine, but --require-gpu was given",
            "run on a GPU pod (then install the JAX build this doctor recommends there)",
        )
    return res(OK, f"{versions}: backend {backend} ({dev_text}); no GPU on this machine{timing}")


def _count(items: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for it in items:
        out[str(it)] = out.get(str(it), 0) + 1
    return out


# ----------------------------------------------------------------------------------------------
# Check 3: PyTorch


def _torch_index_for(ctx: Context) -> str | None:
    try:
        plan = ctx.plan()
    except _FactError:
        return None
    major = plan.get("driver_major")
    if major is None or major < DRIVER_MIN_CUDA12:
        return None
    return f"{_TORCH_INDEX}/cu130" if major >= DRIVER_MIN_CUDA13 else f"{_TORCH_INDEX}/cu128"


def _torch_cuda_fix(ctx: Context) -> str:
    index = _torch_index_for(ctx)
    if index:
        return f"pip install -U --force-reinstall torch --index-url {index}"
    try:
        if ctx.plan()["why"] == "driver too old":
            return _DRIVER_FIX
    except _FactError:
        pass
    return f"pip install -U --force-reinstall torch --index-url {_TORCH_INDEX}/cu128 (driver >= 525; cu130 needs >= 580)"


def _check_torch(ctx: Context) -> CheckResult:
    title = "PyTorch"
    version = _dist_version("torch")
    probe: ProbeResult = ctx.fact("torch_probe")
    details: dict[str, Any] = {"torch": version, "probe": {"status": probe.status, **probe.data}}

    def res(status: str, finding: str, fix: str | None = None) -> CheckResult:
        return CheckResult("torch", title, status, finding, fix, details)

    if probe.status == "skipped":
        return res(OK, "PyTorch is not installed (optional: only the comparison backend needs it)")
    if probe.status == "timeout":
        return res(
            WARN,
            f"torch {version or '?'}: `import torch; torch.cuda.is_available()` did not finish within {_fmt_s(probe.timeout_s)}",
            'run `python -c "import torch; print(torch.cuda.is_available())"` to see where it hangs; '
            "if JAX is fine, reinstall torch: " + _torch_cuda_fix(ctx),
        )
    if probe.status == "crashed":
        return res(
            WARN,
            f"torch {version or '?'}: the torch probe process died ({_signal_name(probe.rc)}): {_first_relevant_line(probe.stderr) or 'no output'}",
            _torch_cuda_fix(ctx),
        )
    data = probe.data
    if not data.get("ok"):
        return res(WARN, f"torch {version or '?'} fails to import: {_first_relevant_line(data.get('error') or '')}", _torch_cuda_fix(ctx))

    v = data.get("version") or version
    cuda_build = data.get("cuda_build")
    available = bool(data.get("cuda_available"))
    gpu = ctx.gpu_present()
    build = f"CUDA {cuda_build} build" if cuda_build else ("ROCm build" if data.get("hip_build") else "CPU build")
    warn_line = _first_relevant_line(*(data.get("warnings") or []))
    if available:
        devices = ", ".join(f"{n}x {k}" for k, n in _count(data.get("devices") or []).items())
        if data.get("compute_error") or data.get("result_ok") is False:
            err = data.get("compute_error") or "wrong result for an 8x8 matmul"
            return res(WARN, f"torch {v} ({build}) sees {devices} but cannot compute on it: {_first_relevant_line(err)}", _torch_cuda_fix(ctx))
        if warn_line and re.search(r"not compatible|capability", warn_line, re.IGNORECASE):
            return res(WARN, f"torch {v} ({build}) sees {devices} but warns: {warn_line}", _torch_cuda_fix(ctx))
        return res(OK, f"torch {v} ({build}): torch.cuda.is_available() is True, {devices}")
    if cuda_build:
        reason = f": {warn_line}" if warn_line else ""
        if gpu:
            return res(WARN, f"torch {v} is a {build} but torch.cuda.is_available() is False although a GPU is present{reason}", _torch_cuda_fix(ctx))
        return res(
            WARN,
            f"torch {v} is a {build} with no usable GPU (torch.cuda.is_available() is False; no GPU on this machine){reason}",
            f"nothing to fix on a GPU pod; on a CPU-only machine the CPU build is smaller: pip install -U --force-reinstall torch --index-url {_TORCH_INDEX}/cpu",
        )
    if gpu:
        return res(WARN, f"torch {v} is a {build}: the torch side runs on CPU although a GPU is present", _torch_cuda_fix(ctx))
    return res(OK, f"torch {v} ({build}); no GPU on this machine")


# ----------------------------------------------------------------------------------------------
# Check 4a: several CUDA library wheels of one family


def _family(name: str, version: str) -> tuple[str, str] | None:
    m = _NVIDIA_FAMILY_RE.match(name)
    if not m:
        return None
    major = m.group(2) or (version.split(".")[0] if version else "?")
    return m.group(1), major


def _lib_files(dist: metadata.Distribution) -> set[str]:
    try:
        files = dist.files or []
    except Exception:
        return set()
    return {str(f).replace("\\", "/") for f in files if ".so" in str(f)}


def _check_cuda_libs(ctx: Context) -> CheckResult:
    title = "CUDA libraries"
    dists = _distributions()
    families: dict[str, list[tuple[str, str, str]]] = {}
    for name, dist in dists.items():
        fam = _family(name, dist.version)
        if fam:
            families.setdefault(fam[0], []).append((name, dist.version, fam[1]))
    details: dict[str, Any] = {fam: [f"{n} {v}" for n, v, _ in sorted(items)] for fam, items in families.items()}

    # who requires which nvidia distribution, and with which specifier
    requirers: dict[str, list[tuple[str, str]]] = {}
    try:
        from packaging.requirements import Requirement

        for name, dist in dists.items():
            for req_s in dist.requires or []:
                try:
                    req = Requirement(req_s)
                except Exception:
                    continue
                target = _norm(req.name)
                if not _NVIDIA_FAMILY_RE.match(target):
                    continue
                if req.marker is not None and not any(
                    _marker_true(req.marker, extra) for extra in ("", "with-cuda", "with_cuda")
                ):
                    continue
                requirers.setdefault(target, []).append((name, str(req.specifier)))
    except ImportError:  # packaging is missing: only the side-by-side test below runs
        pass

    problems: list[str] = []
    fixes: list[str] = []
    for fam, items in sorted(families.items()):
        majors = sorted({m for _, _, m in items})
        if len(items) < 2:
            continue
        desc = []
        for n, v, _ in sorted(items):
            by = sorted({r for r, _ in requirers.get(n, [])})
            desc.append(f"{n} {v}" + (f" (needed by {', '.join(by)})" if by else ""))
        overlap = _shared_files([dists[n] for n, _, _ in items])
        text = f"{len(items)} {fam} wheels installed side by side: {'; '.join(desc)}"
        if overlap:
            text += f"; they write the same file {overlap}, so the one installed last overwrote the other"
        else:
            text += "; torch and JAX may load a different one than they were built for"
        problems.append(text)
        fixes.append(_family_fix(ctx, fam, items, majors, requirers, dists))

    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        for target, reqs in sorted(requirers.items()):
            if target not in dists:
                continue
            installed = dists[target].version
            bad = sorted((r, s) for r, s in reqs if s and not SpecifierSet(s).contains(Version(installed), prereleases=True))
            if not bad:
                continue
            problems.append(
                f"{target} {installed} is installed but "
                + ", ".join(f"{r} requires {target}{s}" for r, s in bad)
            )
            specs = [(r, SpecifierSet(s)) for r, s in reqs if s]
            # A "==" pin that the other requirers reject cannot be met by reinstalling the library:
            # the pinning package has to move (its newer releases pin newer CUDA libraries).
            stuck = sorted(
                {
                    r
                    for r, spec in specs
                    for pin in spec
                    if pin.operator in ("==", "===")
                    and not all(other.contains(pin.version, prereleases=True) for _, other in specs)
                }
            )
            if stuck:
                fixes.append(
                    f"pip install -U {' '.join(stuck)} (its pin on {target} is older than the others accept); "
                    "if no release fits, give torch and JAX separate virtualenvs"
                )
            else:
                combined = ",".join(sorted({s for _, s in reqs if s}))
                fixes.append(f'pip install "{target}{combined}"')
    except ImportError:
        pass

    if not problems:
        found = ", ".join(f"{n} {v}" for items in families.values() for n, v, _ in sorted(items)) or "none installed"
        return CheckResult("cuda_libs", title, OK, f"one cuDNN / cuBLAS wheel per family ({found})", None, details)
    return CheckResult("cuda_libs", title, WARN, " | ".join(problems), " ; ".join(fixes), details)


def _marker_true(marker: Any, extra: str) -> bool:
    try:
        return bool(marker.evaluate({"extra": extra}))
    except Exception:
        return False


def _shared_files(dists: list[metadata.Distribution]) -> str | None:
    seen: dict[str, int] = {}
    for i, d in enumerate(dists):
        for f in _lib_files(d):
            if f in seen and seen[f] != i:
                return f
            seen[f] = i
    return None


def _family_fix(
    ctx: Context,
    fam: str,
    items: list[tuple[str, str, str]],
    majors: list[str],
    requirers: dict[str, list[tuple[str, str]]],
    dists: dict[str, Any],
) -> str:
    """Keep one CUDA major: move the packages that need the other major, drop its wheels."""
    keep = None
    try:
        build = ctx.plan()["build"]
        if build:
            keep = build.removeprefix("cuda")
    except _FactError:
        pass
    if keep not in majors:
        plugin_majors = [m.group(1) for p in dists if (m := re.match(r"jax-cuda(\d+)-plugin$", p))]
        keep = next((m for m in plugin_majors if m in majors), None) or max(majors, key=lambda m: int(m) if m.isdigit() else -1)
    remove = sorted(n for n, _, m in items if m != keep)
    kept = sorted(n for n, _, m in items if m == keep)
    steps: list[str] = []
    users = sorted({r for n in remove for r, _ in requirers.get(n, [])})
    wrong_plugins = sorted(p for p in dists if re.match(rf"jax-cuda(?!{keep}-)\d+-(plugin|pjrt)$", p))
    if wrong_plugins:
        steps.append(f"pip uninstall -y {' '.join(wrong_plugins)}")
    steps.append(f"pip uninstall -y {' '.join(remove)}")
    if any(u.startswith("jax") for u in users) or wrong_plugins:
        steps.append(_pip_jax(f"cuda{keep}"))
    if "torch" in users:
        index = "cu130" if keep == "13" else "cu128"
        steps.append(f"pip install -U --force-reinstall torch --index-url {_TORCH_INDEX}/{index}")
    steps.append(f"pip install --force-reinstall --no-deps {' '.join(kept)}")
    return f"keep CUDA {keep} only: " + " && ".join(steps)


# ----------------------------------------------------------------------------------------------
# Check 4b: LD_LIBRARY_PATH


def _check_ld_library_path(ctx: Context) -> CheckResult:
    title = "LD_LIBRARY_PATH"
    value = os.environ.get("LD_LIBRARY_PATH", "")
    if not value.strip():
        return CheckResult("ld_library_path", title, OK, "LD_LIBRARY_PATH is not set: JAX and torch load the CUDA libraries of their pip wheels")
    entries = [e for e in value.split(":") if e]
    shadowing: list[str] = []
    for e in entries:
        libs: list[str] = []
        try:
            libs = sorted({m.group(1) for p in Path(e).iterdir() if (m := _CUDA_LIB_FILE_RE.match(p.name))})
        except OSError:
            pass
        if libs:
            shadowing.append(f"{e} (lib{', lib'.join(libs)})")
        elif re.search(r"cuda|nvidia|cudnn", e, re.IGNORECASE):
            shadowing.append(e)
    if shadowing:
        finding = (
            f"LD_LIBRARY_PATH={value} puts CUDA libraries ahead of the pip wheels' CUDA: {'; '.join(shadowing)}; "
            "JAX then loads mismatched cuDNN/cuBLAS (JAX recommends leaving it unset)"
        )
    else:
        finding = f"LD_LIBRARY_PATH={value} is set; it can shadow the pip wheels' CUDA libraries (JAX recommends leaving it unset)"
    return CheckResult(
        "ld_library_path",
        title,
        WARN,
        finding,
        "unset LD_LIBRARY_PATH (and remove it from ~/.bashrc / the image's ENV)",
        {"LD_LIBRARY_PATH": entries, "cuda_entries": shadowing},
    )


# ----------------------------------------------------------------------------------------------
# Check 5: GPU memory


_ALLOCATORS = ("default", "platform", "bfc", "cuda_async", "vmm")


def _check_gpu_memory(ctx: Context) -> CheckResult:
    title = "GPU memory"
    env = {
        k: os.environ.get(k)
        for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")
    }
    settings = ", ".join(f"{k}={v}" for k, v in env.items() if v is not None) or "XLA_PYTHON_CLIENT_* unset: JAX defaults"
    details: dict[str, Any] = {"env": env}
    gpu = ctx.gpu_present()
    bad = FAIL if gpu else WARN  # JAX's GPU backend refuses to start on these; harmless without a GPU

    def res(status: str, finding: str, fix: str | None = None) -> CheckResult:
        return CheckResult("gpu_memory", title, status, finding, fix, details)

    before = " (set it before JAX is imported: in the shell or the pod's env, not after `import jax`)"
    allocator = (env["XLA_PYTHON_CLIENT_ALLOCATOR"] or "default").lower()
    if allocator not in _ALLOCATORS:
        return res(bad, f"XLA_PYTHON_CLIENT_ALLOCATOR={env['XLA_PYTHON_CLIENT_ALLOCATOR']} is not one of {', '.join(_ALLOCATORS)}: JAX's GPU backend raises", "unset XLA_PYTHON_CLIENT_ALLOCATOR")
    if env["XLA_PYTHON_CLIENT_MEM_FRACTION"] and env["XLA_CLIENT_MEM_FRACTION"]:
        return res(bad, "both XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are set: JAX's GPU backend raises", "unset XLA_PYTHON_CLIENT_MEM_FRACTION")
    frac_var = "XLA_CLIENT_MEM_FRACTION" if env["XLA_CLIENT_MEM_FRACTION"] else "XLA_PYTHON_CLIENT_MEM_FRACTION"
    frac_raw = env[frac_var]
    fraction = 0.75
    if frac_raw:
        try:
            fraction = float(frac_raw)
            if not math.isfinite(fraction) or not 0.0 < fraction <= 1.0:
                raise ValueError
        except ValueError:
            return res(bad, f"{frac_var}={frac_raw} is not a fraction in (0, 1]", f"export {frac_var}=0.75{before}")
    prealloc_raw = env["XLA_PYTHON_CLIENT_PREALLOCATE"]
    prealloc = not (prealloc_raw in ("false", "False", "0")) and allocator != "platform"
    details.update(preallocate=prealloc, fraction=fraction)
    if not gpu:
        return res(OK, f"no GPU: nothing to allocate ({settings})")
    if prealloc and prealloc_raw and prealloc_raw.strip().lower() in ("false", "0", "no", "off"):
        return res(
            WARN,
            f"XLA_PYTHON_CLIENT_PREALLOCATE={prealloc_raw} does NOT turn preallocation off (JAX accepts only false, False or 0)",
            f"export XLA_PYTHON_CLIENT_PREALLOCATE=false{before}",
        )

    smi = ctx.smi
    total = next((g.memory_mib for g in smi.gpus if g.memory_mib), None)
    if smi.apps is None:
        return res(OK, f"{settings}; could not list GPU processes ({smi.apps_error or 'nvidia-smi unavailable'})")
    apps = [a for a in smi.apps if a.pid != os.getpid()]
    details["other_processes"] = [{"pid": a.pid, "name": a.name, "used_mib": a.used_mib} for a in apps]
    if not apps:
        mode = f"preallocates {fraction:.0%} of GPU memory at startup" if prealloc else "allocates on demand"
        return res(OK, f"no other process on the GPU; JAX {mode} ({settings})")
    used = sum(a.used_mib or 0 for a in apps)
    procs = ", ".join(f"pid {a.pid} {a.name or '?'} {a.used_mib if a.used_mib is not None else '?'} MiB" for a in apps[:4])
    procs += f", +{len(apps) - 4} more" if len(apps) > 4 else ""
    busy = f"{len(apps)} other process(es) use {used} MiB" + (f" of {total} MiB" if total else "") + f" ({procs})"
    if not prealloc:
        return res(OK, f"{busy}; JAX preallocation is off, so it takes memory as needed ({settings})")
    free = (total - used) if total else None
    want = int(fraction * total) if total else None
    suggest = max(0.05, math.floor((free / total) * 0.9 * 100) / 100) if total and free and free > 0 else None
    if frac_raw and want is not None and free is not None and want <= free:
        return res(OK, f"{busy}; {frac_var}={frac_raw} reserves {want} MiB, which fits in the {free} MiB left ({settings})")
    if want is not None and free is not None and want > free:
        consequence = f"JAX will try to reserve {fraction:.0%} ({want} MiB) at startup but only {free} MiB is left: out of memory"
    else:
        consequence = f"JAX reserves {fraction:.0%} of GPU memory at startup and the processes will compete for memory"
    fix = "export XLA_PYTHON_CLIENT_PREALLOCATE=false"
    if suggest:
        fix += f" (or export XLA_PYTHON_CLIENT_MEM_FRACTION={suggest:.2f})"
    fix += before
    return res(WARN, f"{busy} while preallocation is on ({settings}): {consequence}", fix)


# ----------------------------------------------------------------------------------------------
# Check 6: storage


def _disk_usage(path: Path) -> Any:
    return shutil.disk_usage(path)


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _is_under(path: Path, mount: Path) -> bool:
    candidates = {Path(os.path.abspath(path)), Path(os.path.realpath(path))}
    mounts = {Path(os.path.abspath(mount)), Path(os.path.realpath(mount))}
    return any(c == m or m in c.parents for c in candidates for m in mounts)


def _on_runpod() -> bool:
    return any(os.environ.get(k) for k in ("RUNPOD_POD_ID", "RUNPOD_ENDPOINT_ID"))


def _storage_check(
    check_id: str, title: str, path: Path, how: str, fix_var: str, fix_suffix: str, unwritable_status: str
) -> CheckResult:
    from preheat.cache.root import PERSISTENT_MOUNTS

    mounts = list(PERSISTENT_MOUNTS())
    existing = [m for m in mounts if m.is_dir()]
    near = _nearest_existing(path)
    details: dict[str, Any] = {
        "path": str(path),
        "chosen_by": how,
        "exists": path.exists(),
        "checked_at": str(near),
        "persistent_mounts": [str(m) for m in mounts],
    }
    statuses: list[str] = []
    parts: list[str] = [f"{path} (chosen by: {how}{'' if path.exists() else '; not created yet'})"]
    fixes: list[str] = []

    persistent = next((m for m in mounts if _is_under(path, m)), None)
    details["persistent"] = persistent is not None
    if persistent is not None:
        parts.append(f"on the persistent volume {persistent}")
    elif existing:
        target = existing[0]
        statuses.append(WARN)
        parts.append(f"on the container disk, which is lost when the pod restarts ({target} is a persistent volume)")
        fixes.append(f"export {fix_var}={target}{fix_suffix}")
    elif _on_runpod():
        statuses.append(WARN)
        parts.append(f"this pod has no volume ({' or '.join(map(str, mounts))} missing): everything is lost when it stops")
        fixes.append(f"attach a network volume or volume disk (mounted at {mounts[-1]}) and export {fix_var}={mounts[-1]}{fix_suffix}")
    else:
        parts.append(f"not on a Runpod volume (no {' or '.join(map(str, mounts))} on this machine)")

    try:
        usage = _disk_usage(near)
        free_gib = usage.free / 2**30
        details["free_gib"] = round(free_gib, 2)
        if free_gib < MIN_FREE_GIB:
            statuses.append(WARN)
            parts.append(f"only {free_gib:.1f} GiB free on {near} (< {MIN_FREE_GIB:g} GiB)")
            fixes.append(f"free space on {near} or point {fix_var} at a larger volume")
        else:
            parts.append(f"{free_gib:.0f} GiB free")
    except OSError as exc:
        statuses.append(WARN)
        parts.append(f"cannot read free space of {near}: {exc.strerror or exc}")
        fixes.append(f"point {fix_var} at a readable location")

    writable = _writable(near)
    details["writable"] = writable
    if not writable:
        statuses.append(unwritable_status)
        parts.append(f"{near} is not writable by this user")
        fixes.append(f"chmod u+w {near} (or run as its owner), or export {fix_var}=<a writable folder>")
    status = max(statuses, key=_STATUS_ORDER.__getitem__) if statuses else OK
    return CheckResult(check_id, title, status, "; ".join(parts), " ; ".join(fixes) if fixes else None, details)


def _check_cache_root(ctx: Context) -> CheckResult:
    from preheat.cache.root import resolve_root

    root = resolve_root(create=False)
    return _storage_check("storage_cache", "preheat cache", root.path, root.reason, "PREHEAT_HOME", _preheat_suffix(), FAIL)


def _preheat_suffix() -> str:
    # The same layout resolve_root uses on each volume.
    from preheat.cache.root import PERSISTENT_MOUNTS

    mounts = [m for m in PERSISTENT_MOUNTS() if m.is_dir()]
    if mounts and mounts[0] == PERSISTENT_MOUNTS()[0]:
        return "/preheat"  # Runpod network volume
    return "/.cache/preheat"


def _hf_hub_cache() -> tuple[Path, str, str, str]:
    """(path, how it was chosen, env var to fix it with, suffix under a volume for that var)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser().absolute(), f"${var} is set", var, "/.cache/huggingface/hub"
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser().absolute() / "hub", "$HF_HOME/hub", "HF_HOME", "/.cache/huggingface"
    if os.environ.get("XDG_CACHE_HOME"):
        return (
            Path(os.environ["XDG_CACHE_HOME"]).expanduser().absolute() / "huggingface" / "hub",
            "$XDG_CACHE_HOME/huggingface/hub",
            "HF_HOME",
            "/.cache/huggingface",
        )
    return Path.home() / ".cache" / "huggingface" / "hub", "default (~/.cache/huggingface/hub)", "HF_HOME", "/.cache/huggingface"


def _check_hf_cache(ctx: Context) -> CheckResult:
    path, how, var, suffix = _hf_hub_cache()
    return _storage_check("storage_hf", "HF cache", path, how, var, suffix, WARN)


# ----------------------------------------------------------------------------------------------
# Check 7: cache health (the lead wires this to `preheat cache verify` once preheat.cache.store exists)


def _check_cache_health(root: Path) -> CheckResult:
    """Entry count, size, and entries that fail verification (what `preheat cache verify` checks)."""
    from preheat.cache.manage import verify_entries
    from preheat.store import verify_store

    title = "Cache health"
    if not root.exists():
        return CheckResult("cache_health", title, OK, f"{root} does not exist yet: nothing cached", None, {"root": str(root)})
    infos = verify_entries(root)
    store_problems = verify_store(root)
    size = sum(i.size for i in infos)
    bad = [i for i in infos if not i.ok]
    details = {"root": str(root), "entries": len(infos), "bytes": size, "bad": [f"{i.kind}/{i.key}" for i in bad],
               "store_problems": [str(p) for p in store_problems]}
    finding = f"{len(infos)} compiled entries ({size / 1e6:.1f} MB)"
    if bad or store_problems:
        what = [f"{len(bad)} compile entries fail verification"] if bad else []
        what += [f"{len(store_problems)} weights-store problems"] if store_problems else []
        return CheckResult("cache_health", title, WARN, f"{finding}; {', '.join(what)} (they are recompiled or re-fetched)",
                           "preheat cache verify --quarantine && preheat cache prune", details)
    return CheckResult("cache_health", title, OK, f"{finding}, all verify; weights store verifies", None, details)


def _check_cache(ctx: Context) -> CheckResult:
    from preheat.cache.root import resolve_root

    return _check_cache_health(resolve_root(create=False).path)


# ----------------------------------------------------------------------------------------------
# Running everything

# (id, title, function name). Functions are looked up by name at run time so tests can replace one.
_CHECKS: tuple[tuple[str, str, str], ...] = (
    ("accelerator", "Accelerator", "_check_accelerator"),
    ("jax", "JAX backend", "_check_jax"),
    ("torch", "PyTorch", "_check_torch"),
    ("cuda_libs", "CUDA libraries", "_check_cuda_libs"),
    ("ld_library_path", "LD_LIBRARY_PATH", "_check_ld_library_path"),
    ("gpu_memory", "GPU memory", "_check_gpu_memory"),
    ("storage_cache", "preheat cache", "_check_cache_root"),
    ("storage_hf", "HF cache", "_check_hf_cache"),
    ("cache_health", "Cache health", "_check_cache"),
)


def _gather(ctx: Context) -> None:
    """nvidia-smi first (so the probes' own CUDA contexts never count as "other processes"), then
    the JAX and torch probes side by side."""
    ctx.gather("dev", _dev_nodes)
    ctx.gather("smi", lambda: _query_nvidia_smi(ctx.smi_timeout))

    def jax_probe() -> ProbeResult:
        if not os.environ.get("PREHEAT_DOCTOR_JAX_PROBE") and _dist_version("jax") is None:
            return ProbeResult("skipped")
        return _run_probe("PREHEAT_DOCTOR_JAX_PROBE", _JAX_PROBE_SRC, ctx.probe_timeout)

    def torch_probe() -> ProbeResult:
        if not os.environ.get("PREHEAT_DOCTOR_TORCH_PROBE") and _dist_version("torch") is None:
            return ProbeResult("skipped")
        return _run_probe("PREHEAT_DOCTOR_TORCH_PROBE", _TORCH_PROBE_SRC, ctx.probe_timeout)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {"jax_probe": pool.submit(jax_probe), "torch_probe": pool.submit(torch_probe)}
        for name, fut in futures.items():
            ctx.gather(name, fut.result)


def _versions(ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
    }
    for name in ("preheat", "jax", "jaxlib", "torch", "numpy", "flax"):
        out[name] = _dist_version(name)
    try:
        out["jax_plugins"] = _jax_gpu_plugins()
    except Exception:
        out["jax_plugins"] = {}
    try:
        smi = ctx.smi
        out["nvidia_driver"] = smi.driver
        out["cuda_driver_supports"] = smi.cuda
    except _FactError:
        out["nvidia_driver"] = out["cuda_driver_supports"] = None
    for probe_name, key in (("jax_probe", "jax_backend"), ("torch_probe", "torch_cuda")):
        try:
            data = ctx.fact(probe_name).data
            out[key] = data.get("backend") if key == "jax_backend" else data.get("cuda_build")
        except (_FactError, KeyError):
            out[key] = None
    return out


def run_checks(require_gpu: bool = False) -> Report:
    """Run every check; never raises. A check that raises is reported as ``fail`` with its error."""
    t0 = time.monotonic()
    ctx = Context(require_gpu=require_gpu)
    _gather(ctx)
    module = sys.modules[__name__]
    results: list[CheckResult] = []
    for check_id, title, fn_name in _CHECKS:
        try:
            result = getattr(module, fn_name)(ctx)
            if result.status not in _STATUS_ORDER:
                raise ValueError(f"check returned unknown status {result.status!r}")
        except Exception as exc:
            what = str(exc) if isinstance(exc, _FactError) else f"the check itself raised {type(exc).__name__}: {exc}"
            result = CheckResult(
                check_id,
                title,
                FAIL,
                what,
                "this is a bug in preheat doctor: report it with the output of `preheat doctor --json`",
                {"error": f"{type(exc).__name__}: {exc}"},
            )
        results.append(result)
    try:
        versions = _versions(ctx)
    except Exception as exc:
        versions = {"error": f"{type(exc).__name__}: {exc}"}
    report = Report(results, versions, require_gpu=require_gpu, gpu_backend=ctx.gpu_backend)
    if require_gpu and ctx.gpu_backend is not True:
        jax_check = next((c for c in results if c.id == "jax"), None)
        if jax_check is not None and jax_check.status != FAIL:  # say why the exit code is 1
            jax_check.status = FAIL
            jax_check.finding += "; --require-gpu: no GPU backend in use"
            jax_check.fix = jax_check.fix or "run on a GPU pod"
    report.elapsed_s = time.monotonic() - t0
    return report


# ----------------------------------------------------------------------------------------------
# CLI

_STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red"}


def _render(report: Report) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 140
    console = Console(highlight=False, width=width, soft_wrap=False)
    table = Table(title="preheat doctor", show_lines=False, expand=False)
    table.add_column("Check", no_wrap=True)
    table.add_column("Status", no_wrap=True)
    table.add_column("Finding", overflow="fold")
    for c in report.checks:
        table.add_row(Text(c.title), Text(c.status.upper(), style=_STYLE[c.status]), Text(c.finding))
    console.print(table)
    todo = [c for c in report.checks if c.status != OK and c.fix]
    if todo:
        console.print(Text("How to fix:", style="bold"))
        for c in todo:
            line = Text(f"  [{c.status}] {c.title}: ", style=_STYLE[c.status])
            line.append(Text(c.fix or "", style="default"))
            console.print(line, soft_wrap=True)
    s = report.summary
    v = report.versions
    console.print(
        Text(
            f"{s[OK]} ok, {s[WARN]} warn, {s[FAIL]} fail in {report.elapsed_s:.1f} s; exit {report.exit_code}"
            + (" (--require-gpu)" if report.require_gpu else "")
        ),
        soft_wrap=True,
    )
    plugins = ", ".join(f"{k} {val}" for k, val in (v.get("jax_plugins") or {}).items())
    console.print(
        Text(
            f"python {v.get('python')} | preheat {v.get('preheat')} | jax {v.get('jax')} | jaxlib {v.get('jaxlib')}"
            + (f" | {plugins}" if plugins else "")
            + f" | torch {v.get('torch')}"
            + (f" | driver {v['nvidia_driver']} (CUDA {v.get('cuda_driver_supports') or '?'})" if v.get("nvidia_driver") else " | no NVIDIA driver"),
            style="dim",
        ),
        soft_wrap=True,
    )


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (checks, summary, versions) instead of a table.")
@click.option("--require-gpu", is_flag=True, help="Exit 1 unless JAX actually computes on a GPU.")
@click.pass_context
def doctor_command(ctx: click.Context, as_json: bool, require_gpu: bool) -> None:
    """Say what is wrong with this machine's GPU / JAX / torch / cache setup, and the exact fix.

    Exit status: 0 when no check fails, 1 when one does (or, with --require-gpu, when JAX is not
    computing on a GPU).
    """
    try:
        report = run_checks(require_gpu=require_gpu)
    except Exception as exc:  # run_checks should not raise; never show a traceback anyway
        msg = f"preheat doctor failed: {type(exc).__name__}: {exc}"
        if as_json:
            click.echo(json.dumps({"ok": False, "exit_code": 1, "error": msg, "checks": [], "summary": {OK: 0, WARN: 0, FAIL: 1}, "versions": {}}))
        else:
            click.echo(msg, err=True)
        ctx.exit(1)
        return
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        _render(report)
    ctx.exit(report.exit_code)
