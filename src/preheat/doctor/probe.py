"""Running a probe module in a fresh process and reading its one JSON line back."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from preheat.doctor.runner import _run

PROBE_MARK = "PREHEAT_DOCTOR_PROBE="


@dataclass
class ProbeResult:
    status: str  # "ok" (JSON received) | "timeout" | "crashed" | "skipped"
    data: dict[str, Any] = field(default_factory=dict)
    stderr: str = ""
    rc: int | None = None
    elapsed_s: float = 0.0
    timeout_s: float = 0.0


def _probe_env() -> dict[str, str] | None:
    """The probe's environment: this one, plus preheat's folder on PYTHONPATH when a fresh
    interpreter would not find it there (a source checkout run without installing). None: inherit.

    A site-packages folder is never prepended: it would shadow the standard library."""
    import site

    here = str(Path(__file__).resolve().parents[2])  # the folder holding the preheat package
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    site_dirs = [*site.getsitepackages(), site.getusersitepackages()]
    if any(os.path.realpath(p) == here for p in current + site_dirs):
        return None
    return {**os.environ, "PYTHONPATH": os.pathsep.join([here, *current])}


def _run_probe(hook_var: str, module: str, timeout: float) -> ProbeResult:
    """Run ``python -m module`` (or the test hook ``$hook_var``) and read its ``PROBE_MARK`` line."""
    hook = os.environ.get(hook_var, "").strip()
    argv = shlex.split(hook) if hook else [sys.executable, "-m", module]
    r = _run(argv, timeout, env=None if hook else _probe_env())
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
