"""Run the app with uvicorn, with Cog-style draining on SIGTERM/SIGINT.

On the first signal the core stops accepting predictions (new ones get 503, health-check
says BUSY with ``draining: true``), the ones already accepted finish (up to ``grace_s``), their
responses and final webhooks go out, then the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Callable, Optional

import uvicorn

from preheat.server.app import create_app
from preheat.server.core import Core, CoreConfig

__all__ = ["DrainingServer", "bind_socket", "serve"]

log = logging.getLogger("preheat.server")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 = any free port; read it back with ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose signal handler drains the core before exiting."""

    def __init__(self, config: uvicorn.Config, core: Core, grace_s: float) -> None:
        super().__init__(config)
        self.core = core
        self.grace_s = grace_s
        self._drain_started = False
        self.drained: Optional[bool] = None  # True: every accepted prediction finished in time

    def handle_exit(self, sig: int, frame: Any) -> None:  # called in the main thread by the signal
        if self._drain_started:
            self.should_exit = True
            self.force_exit = True
            return
        self._drain_started = True
        self.core.begin_drain()
        threading.Thread(target=self._drain, name="preheat-drain", daemon=True).start()

    def _drain(self) -> None:
        log.warning("draining: %d prediction(s) in flight, grace %.0fs", self.core.in_flight, self.grace_s)
        self.drained = self.core.wait_idle(self.grace_s)
        if not self.drained:
            log.warning("grace period over; failing the predictions still waiting")
        self.core.close(timeout=1.0)
        self.should_exit = True


def serve(config: CoreConfig, *, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0,
          token: Optional[str] = None, log_level: str = "info",
          announce: Callable[[str], None] = print) -> int:
    """Start the core (set-up in the background) and serve HTTP until a signal; returns 0."""
    sock = bind_socket(host, port)
    core = Core(config).start()
    app = create_app(core, token=token, grace_s=grace_s)
    uv_config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                               timeout_graceful_shutdown=max(1, int(grace_s)), timeout_keep_alive=5)
    server = DrainingServer(uv_config, core, grace_s)
    bound_host, bound_port = sock.getsockname()[:2]
    announce(f"preheat serve: listening on http://{bound_host}:{bound_port} (status: STARTING until warm-up ends)")
    server.run(sockets=[sock])
    if not core.draining:  # stopped without a signal (e.g. lifespan failure)
        core.close(timeout=1.0)
    return 0
