"""``python -m preheat.server`` as a child process: what ``preheat bench serve`` load-tests, and
what the server tests run when they need a real process (SIGTERM, memory, exit codes).

The child's stderr is drained by a thread (so it can never block on a full pipe); the port it
listens on is read from its ``listening on http://HOST:PORT`` line, so ``--port 0`` works.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

__all__ = ["ServerProcess"]

_LISTENING = re.compile(r"listening on http://([^\s]+):(\d+)")


class ServerProcess:
    """``python -m preheat.server ARGS`` with ``env`` (default: this process's) in ``cwd``."""

    def __init__(self, args: list[str], env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "preheat.server", *args], env=env, cwd=cwd,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.host: Optional[str] = None
        self.port: Optional[int] = None
        self._port_seen = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            m = _LISTENING.search(line)
            if m and self.port is None:
                self.host, self.port = m.group(1), int(m.group(2))
                self._port_seen.set()
        self._port_seen.set()  # the child closed stderr (exited) without listening

    def wait_port(self, timeout: float) -> int:
        """The port, once the child says it listens; RuntimeError with its last lines if it never does."""
        if not self._port_seen.wait(timeout) or self.port is None:
            raise RuntimeError("server did not start:\n" + "\n".join(self.lines[-30:]))
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def terminate(self) -> None:
        """SIGTERM: the server drains (finishes what it accepted) and exits."""
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code; killed (-9) when it has not exited within ``timeout``."""
        if self.proc.poll() is None:
            self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9
