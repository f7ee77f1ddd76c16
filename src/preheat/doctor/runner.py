"""Running external commands without ever hanging: each in its own process group, killed with its
children when the timeout fires."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

DEFAULT_SMI_TIMEOUT_S = 5.0
DEFAULT_PROBE_TIMEOUT_S = 20.0


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


def _run(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> CmdResult:
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
            env=env,
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
