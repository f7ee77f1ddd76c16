"""Check 5: GPU memory -- XLA allocator settings, and preallocation while other processes hold the GPU."""

from __future__ import annotations

import math
import os
from typing import Any

from preheat.doctor.context import Context
from preheat.doctor.results import FAIL, OK, WARN, Check, CheckResult

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


GPU_MEMORY = Check("gpu_memory", "GPU memory", _check_gpu_memory)
