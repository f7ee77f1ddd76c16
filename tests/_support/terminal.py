"""Run a command with its stderr on a pseudo-terminal (what a person at a shell sees), stdout piped.

Why a pty and not a flag: the commands decide to draw progress from ``isatty()`` itself; only a
real terminal device tells whether they do so, and whether a pipe gets none of it.
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import threading
from typing import NamedTuple, Optional

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


class Captured(NamedTuple):
    returncode: int
    stdout: str
    stderr: str  # as the terminal received it (escape sequences and all)

    @property
    def plain_stderr(self) -> str:
        """stderr without escape sequences and carriage returns."""
        return ANSI.sub("", self.stderr)


def run_on_terminal(args: list[str], env: Optional[dict[str, str]] = None, timeout: float = 300.0,
                    cwd: Optional[str] = None) -> Captured:
    """``args`` with stderr on a fresh pty (80 columns); bounded by ``timeout`` (then killed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env, cwd=cwd)
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{args} did not finish within {timeout:g}s")
    finally:
        reader.join(10)
        os.close(master)
    return Captured(proc.returncode, out.decode(errors="replace"), b"".join(chunks).decode(errors="replace"))


def run_piped(args: list[str], env: Optional[dict[str, str]] = None, timeout: float = 300.0,
              cwd: Optional[str] = None) -> Captured:
    """``args`` with stdout and stderr both pipes (a script, a log file)."""
    r = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, env=env, cwd=cwd, timeout=timeout)
    return Captured(r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace"))
