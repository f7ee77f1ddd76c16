"""The checks of a TPU VM: the chips, JAX on them, and what stops or slows the TPU runtime.

They replace the NVIDIA checks where the host says a TPU is attached (``preheat.doctor.tpu_host``):

    accelerator    the chips: kind, count, topology, HBM each, libtpu (from the probe and the host)
    jax            JAX computes on the TPU; else why not, with the one command that fixes it: a jax
                   without libtpu (silently on the CPU), JAX_PLATFORMS, the chip held by another
                   process (libtpu's lockfile), a libtpu that does not match jax
    tpu_hugepages  transparent hugepages (JAX warns unless [always] on v5e and newer: slower start)
    tpu_memory     XLA_PYTHON_CLIENT_* set on a TPU VM: read only by JAX's GPU client, no effect here
"""

from __future__ import annotations

import os
import re
from typing import Any

from preheat.doctor import dists
from preheat.doctor.context import Context, _count
from preheat.doctor.probe import ProbeResult, _first_relevant_line, _signal_name
from preheat.doctor.results import FAIL, OK, WARN, Check, CheckResult
from preheat.doctor.runner import _fmt_s
from preheat.doctor.tpu_host import THP, TpuHost

# libtpu's words when another process has the chip (the lockfile, then the /proc scan)
_IN_USE_RE = re.compile(r"libtpu multi-process lockfile|TPU is already in use|already in use by process|libtpu\.so already in use",
                        re.IGNORECASE)
_PID_RE = re.compile(r"process with pid (\d+)")
_HUGEPAGES_FROM = ("v5e", "v6e", "tpu7x", "tpu8i", "tpu8t")  # JAX warns from v5e on (hardware_utils.TpuVersion)
_GPU_CLIENT_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
                    "XLA_PYTHON_CLIENT_ALLOCATOR")


def libtpu_version() -> tuple[str, str] | None:
    """(distribution, version) of the installed libtpu: ``libtpu`` (jax >= 0.4.3x) or ``libtpu-nightly``;
    else the library JAX loads from ``$TPU_LIBRARY_PATH`` (an image's own build) when that file exists."""
    for name in ("libtpu", "libtpu-nightly"):
        version = dists._dist_version(name)
        if version:
            return name, version
    path = os.environ.get("TPU_LIBRARY_PATH", "").strip()
    if path and os.path.isfile(path):
        return "libtpu", f"from TPU_LIBRARY_PATH={path}"
    return None


def _pip_tpu() -> str:
    jax_v = dists._dist_version("jax")
    pin = f"=={jax_v}" if jax_v else ""
    return f'pip install "jax[tpu]{pin}" (jax\'s tpu extra brings the libtpu built for it; from a preheat checkout: pip install ".[tpu]")'


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.2f} GiB" if n else "HBM unknown"


def _device(ctx: Context) -> dict[str, Any]:
    probe: ProbeResult = ctx.fact("jax_probe")
    return dict(probe.data.get("device") or {}) if probe.status == "ok" else {}


def _topology(dev: dict[str, Any], host: TpuHost, chips: int | None = None) -> str:
    """What JAX sees (its chips' coordinate bounds) beside the slice the VM says it is part of
    (a sandbox may be given one chip of a v5litepod-4)."""
    bounds = "x".join(str(b) for b in dev["bounds"]) if dev.get("bounds") else None
    kind, topo = host.env.get("TPU_ACCELERATOR_TYPE"), host.env.get("TPU_TOPOLOGY")
    slice_text = f"the {kind} slice" + (f", topology {topo}" if topo else "") if kind else None
    if bounds and slice_text and chips:
        return f"JAX sees {chips} chip{'s' * (chips != 1)} ({bounds}) of {slice_text}"
    if bounds:
        return f"topology {bounds}"
    return slice_text or ""


def _holder_fix(host: TpuHost, error: str = "") -> tuple[str, str]:
    """(what, fix) for a chip another process holds -- the processes /proc shows, else the pid
    libtpu names (a process of another user) -- or for a lockfile left behind."""
    named = [(h.pid, f"pid {h.pid} ({h.name}) has {h.node} open") for h in host.holders[:4]]
    m = _PID_RE.search(error)
    if not named and m:
        named = [(int(m.group(1)), f"pid {m.group(1)}")]
    if named:
        pids = " ".join(str(pid) for pid, _ in named)
        return (f"the TPU is held by another process: {', '.join(text for _, text in named)}; one process owns a chip",
                f"stop it (`kill {pids}`, or wait for it to finish), then run again")
    lock = host.lockfile or "/tmp/libtpu_lockfile"
    if host.lockfile and host.lockfile_uid is not None and host.lockfile_uid != os.getuid():
        return (f"libtpu's lockfile {lock} belongs to another user (uid {host.lockfile_uid}) and no process of "
                "this user holds the chip", f"sudo rm {lock} (if `sudo lsof -w /dev/accel* /dev/vfio/*` lists no process)")
    return (f"libtpu's lockfile {lock} is left from a process that is gone (no process holds the chip)",
            f"rm {lock}")


def _check_tpu_accelerator(ctx: Context) -> CheckResult:
    host = ctx.tpu
    dev = _device(ctx)
    probe: ProbeResult = ctx.fact("jax_probe")
    libtpu = libtpu_version()
    details: dict[str, Any] = {
        "evidence": host.evidence, "generation": host.generation, "pci_chips": host.pci_chips, "nodes": host.nodes,
        "env": host.env, "libtpu": f"{libtpu[0]} {libtpu[1]}" if libtpu else None, **dev,
    }
    lib = f"; {libtpu[0]} {libtpu[1]}" if libtpu else "; no libtpu installed"
    on_tpu = probe.status == "ok" and probe.data.get("ok") and probe.data.get("backend") == "tpu"
    if on_tpu:
        kinds = probe.data.get("devices") or []
        per_chip = int(dev.get("cores_per_chip") or 1)
        chips = ", ".join(f"{n // per_chip}x {k}" for k, n in _count(kinds).items())
        topo = _topology(dev, host, len(kinds) // per_chip)
        finding = f"{chips}, {_gib(dev.get('bytes_limit'))} HBM each{'; ' + topo if topo else ''}{lib}"
        return CheckResult("accelerator", "Accelerator", OK, finding, None, details)
    chips = f"{host.pci_chips}x TPU {host.generation}" if host.pci_chips else f"TPU {host.generation or ''}".strip()
    seen = "; ".join([_topology(dev, host)] * bool(_topology(dev, host)) + ["seen from " + ", ".join(host.evidence)])
    finding = f"TPU VM: {chips} ({seen}){lib}; JAX does not compute on it (see JAX backend)"
    return CheckResult("accelerator", "Accelerator", OK, finding, None, details)


def _check_tpu_jax(ctx: Context) -> CheckResult:
    host = ctx.tpu
    jax_v, jaxlib_v = dists._dist_version("jax"), dists._dist_version("jaxlib")
    libtpu = libtpu_version()
    probe: ProbeResult = ctx.fact("jax_probe")
    details: dict[str, Any] = {"jax": jax_v, "jaxlib": jaxlib_v, "libtpu": libtpu[1] if libtpu else None,
                               "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"),
                               "probe": {"status": probe.status, "elapsed_s": round(probe.elapsed_s, 2), **probe.data}}
    versions = f"jax {jax_v or '?'} / jaxlib {jaxlib_v or '?'} + " + (f"{libtpu[0]} {libtpu[1]}" if libtpu else "no libtpu")
    ctx.gpu_backend = False

    def res(status: str, finding: str, fix: str | None = None) -> CheckResult:
        return CheckResult("jax", "JAX backend", status, finding, fix, details)

    if probe.status == "skipped":
        return res(FAIL, "jax is not installed on this TPU VM", _pip_tpu())
    if probe.status == "timeout":
        if host.holders:
            what, fix = _holder_fix(host)
            return res(FAIL, f"{versions}: `import jax` did not finish within {_fmt_s(probe.timeout_s)}: {what}", fix)
        return res(FAIL, f"{versions}: `import jax` + a tiny computation did not finish within {_fmt_s(probe.timeout_s)} "
                         "(the TPU runtime starting slowly, or hung)",
                   "rerun with PREHEAT_DOCTOR_TIMEOUT=120; if it still hangs, run "
                   '`python -c "import jax; print(jax.devices())"` to see where')
    if probe.status == "crashed":
        line = _first_relevant_line(probe.stderr)
        if _IN_USE_RE.search(probe.stderr):
            what, fix = _holder_fix(host, probe.stderr)
            return res(FAIL, f"{versions}: {what}", fix)
        return res(FAIL, f"{versions}: the JAX probe process died ({_signal_name(probe.rc)}): {line or 'no output'}",
                   _pip_tpu())
    data = probe.data
    errors = " ".join([str(data.get("error") or ""), *map(str, (data.get("backend_errors") or {}).values()),
                       *map(str, data.get("warnings") or [])])
    if _IN_USE_RE.search(errors):
        what, fix = _holder_fix(host, errors)
        return res(FAIL, f"{versions}: {what}", fix)
    if not data.get("ok"):
        line = _first_relevant_line(str(data.get("error") or "unknown error"))
        return res(FAIL, f"{versions}: JAX fails to start: {line}", _pip_tpu())
    backend = str(data.get("backend") or "unknown")
    dev_text = ", ".join(f"{n}x {k}" for k, n in _count(data.get("devices") or []).items()) or "no devices"
    details["backend"] = backend
    if data.get("result_ok") is False:
        return res(FAIL, f"{versions}: backend {backend} ({dev_text}) computed a WRONG result for an 8x8 matmul", _pip_tpu())
    timing = f" (import + test matmul in {data.get('elapsed_s', probe.elapsed_s):.1f} s)"
    if backend == "tpu":
        return res(OK, f"{versions}: backend tpu, {dev_text}{timing}")
    jp = os.environ.get("JAX_PLATFORMS", "").strip()
    if jp and "tpu" not in [p.strip() for p in jp.split(",")]:
        return res(FAIL, f"{versions}: JAX runs on {backend} on a TPU VM: JAX_PLATFORMS={jp} keeps it off the TPU",
                   "unset JAX_PLATFORMS")
    if not libtpu:
        return res(FAIL, f"{versions}: JAX runs on {backend} on a TPU VM: this jax has no libtpu, so it never tries the TPU",
                   _pip_tpu())
    tpu_err = (data.get("backend_errors") or {}).get("tpu")
    why = f": {_first_relevant_line(tpu_err)}" if tpu_err else " (libtpu is installed but not loaded)"
    return res(FAIL, f"{versions}: JAX runs on {backend} on a TPU VM{why}", _pip_tpu())


def _check_hugepages(ctx: Context) -> CheckResult:
    host = ctx.tpu
    details = {"transparent_hugepage": host.thp, "generation": host.generation}

    def res(status: str, finding: str, fix: str | None = None) -> CheckResult:
        return CheckResult("tpu_hugepages", "Hugepages", status, finding, fix, details)

    path = "/" + THP
    if host.thp is None:
        return res(OK, f"cannot read {path}: not checked")
    if host.thp == "always":
        return res(OK, "transparent hugepages [always]: the TPU runtime starts and stops at full speed")
    if host.generation and host.generation not in _HUGEPAGES_FROM:
        return res(OK, f"transparent hugepages [{host.thp}]: JAX asks for [always] only from TPU v5e on (this is {host.generation})")
    return res(WARN, f"transparent hugepages are [{host.thp}], not [always]: JAX warns, and the TPU runtime starts and "
                     "stops slower (v5e and newer)",
               f"echo always | sudo tee {path} (until reboot; transparent_hugepage=always on the kernel command line keeps it)")


def _check_tpu_memory(ctx: Context) -> CheckResult:
    host = ctx.tpu
    env = {k: os.environ[k] for k in _GPU_CLIENT_VARS if os.environ.get(k) is not None}
    dev = _device(ctx)
    details: dict[str, Any] = {"env": env, "bytes_limit": dev.get("bytes_limit"), "bytes_in_use": dev.get("bytes_in_use")}
    hbm = f", {_gib(dev.get('bytes_limit'))}," if dev.get("bytes_limit") else ""
    owner = f"the TPU runtime gives one process each chip's whole HBM{hbm} with no preallocation and no fraction to set"
    if not env:
        return CheckResult("tpu_memory", "TPU memory", OK, owner, None, details)
    chips = host.pci_chips or len(host.nodes)
    split = ("; to run two processes, give each its own chips: TPU_VISIBLE_CHIPS=0 (1, ...) "
             "TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1 TPU_PROCESS_BOUNDS=1,1,1" if chips > 1 else
             "; this VM has one chip: one process at a time")
    names = ", ".join(f"{k}={v}" for k, v in env.items())
    return CheckResult("tpu_memory", "TPU memory", WARN,
                       f"{names}: read only by JAX's GPU client, no effect on a TPU: {owner}",
                       f"unset {' '.join(env)}{split}", details)


TPU_ACCELERATOR = Check("accelerator", "Accelerator", _check_tpu_accelerator)
TPU_JAX = Check("jax", "JAX backend", _check_tpu_jax)
TPU_HUGEPAGES = Check("tpu_hugepages", "Hugepages", _check_hugepages)
TPU_MEMORY = Check("tpu_memory", "TPU memory", _check_tpu_memory)
