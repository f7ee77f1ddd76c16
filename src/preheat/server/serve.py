"""Run the app with uvicorn, with Cog-style draining on SIGTERM/SIGINT.

On the first signal the core stops accepting predictions (new ones get 503, health-check
says BUSY with ``draining: true``), the ones already accepted finish (up to ``grace_s``), their
responses and final webhooks go out, then the process exits 0. A second signal cuts the drain
short: the running predictions fail as the queued ones do (``SHUT_DOWN``: each route's JSON answer
for it, a 503 on OpenAI's), their responses go out, and the process exits 1 after one log line,
without waiting for the engine call still running. A third signal exits (2) at once.

Read timeouts: uvicorn closes idle keep-alive connections, but not a connection that trickles its
headers (a slow-loris holds a slot forever). :func:`header_timeout` adds that to uvicorn's HTTP
protocol: a request's headers must be complete within ``header_timeout_s`` of its first byte
(or of the connection opening). The body's own timeout is the app's (``body_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import threading
from typing import Any, Callable, Optional

import uvicorn

from preheat.server.app import BODY_TIMEOUT_S, MAX_BODY_BYTES, create_app
from preheat.server.core import Core, CoreConfig
from preheat.server.webhooks import WebhookPolicy

__all__ = ["DrainingServer", "bind_socket", "header_timeout", "uvicorn_config", "serve", "HEADER_TIMEOUT_S",
           "MAX_HEADER_BYTES", "MAX_HEADERS"]

HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 64 << 10  # a request's head in all (request line and headers)
MAX_HEADERS = 100  # header lines per request

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


def _too_large(max_bytes: int, max_headers: int) -> bytes:
    body = json.dumps({"detail": f"request headers over {max_bytes} bytes or {max_headers} lines"}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def header_timeout(base: type[asyncio.Protocol], timeout_s: float, max_bytes: int = MAX_HEADER_BYTES,
                   max_headers: int = MAX_HEADERS) -> type[asyncio.Protocol]:
    """``base`` (one of uvicorn's HTTP protocols) that closes a connection whose request headers are
    not complete ``timeout_s`` after the request's first byte, or after the connection opened; and
    that answers 431 and closes when a request's head (request line and headers) passes
    ``max_bytes`` or ``max_headers`` lines. The head is measured before the parser sees it, so
    nothing past the limit is ever buffered (httptools, unlike h11, has no limit of its own)."""

    class HeaderTimeout(base):  # type: ignore[valid-type, misc]
        _header_timer: Optional[asyncio.TimerHandle] = None
        _armed_for: Any = None  # the request cycle current when armed; a new one = headers arrived
        _counting = False  # inside a request's head
        _head_done_for: Any = False  # the cycle current when the last head ended (False: none yet)
        _head_bytes = _head_lines = 0
        _tail = b""  # the last 3 bytes seen, for a head end split between reads

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first byte of a new request
            if not self._counting and (self.cycle is None or self.cycle.response_complete) \
                    and self.cycle is not self._head_done_for:
                self._counting, self._head_bytes, self._head_lines, self._tail = True, 0, 0, b""
            if self._counting and not self._head_within_limits(data):
                log.info("closing a connection whose request headers are over the limits (431)")
                self.transport.write(_too_large(max_bytes, max_headers))
                self.transport.close()
                return
            super().data_received(data)

        def _head_within_limits(self, data: bytes) -> bool:
            window = self._tail + data
            end = window.find(b"\r\n\r\n")
            head = window if end < 0 else window[:end + 4]
            size = self._head_bytes + len(head) - len(self._tail)
            lines = self._head_lines + head.count(b"\n") - self._tail.count(b"\n")
            if size > max_bytes or lines > max_headers + 2:  # + the request line and the blank line
                return False
            if end >= 0:
                self._counting, self._head_done_for = False, self.cycle
            else:
                self._head_bytes, self._head_lines, self._tail = size, lines, window[-3:]
            return True

        def connection_lost(self, exc: Optional[Exception]) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._armed_for = self.cycle
            self._header_timer = self.loop.call_later(timeout_s, self._expired)

        def _expired(self) -> None:
            self._header_timer = None
            if self.cycle is not self._armed_for:  # the headers were complete in time
                return
            if not self.transport.is_closing():
                log.info("closing a connection whose request headers took over %gs", timeout_s)
                self.transport.close()

    HeaderTimeout.__name__ = HeaderTimeout.__qualname__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeout


def uvicorn_config(app: Any, *, log_level: str = "info", grace_s: float = 30.0,
                   header_timeout_s: float = HEADER_TIMEOUT_S, max_header_bytes: int = MAX_HEADER_BYTES,
                   max_headers: int = MAX_HEADERS) -> uvicorn.Config:
    """The uvicorn settings ``preheat serve`` runs with (tests serve through the same)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=max(1, int(grace_s)), timeout_keep_alive=5,
                          h11_max_incomplete_event_size=max_header_bytes + 1024,  # ours answers first
                          http=header_timeout(AutoHTTPProtocol, header_timeout_s, max_header_bytes, max_headers))


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose signal handler drains the core before exiting."""

    def __init__(self, config: uvicorn.Config, core: Core, grace_s: float) -> None:
        super().__init__(config)
        self.core = core
        self.grace_s = grace_s
        self.signals = 0
        self.drained: Optional[bool] = None  # True: every accepted prediction finished in time
        self.cut_short = False  # a second signal ended the drain early

    def handle_exit(self, sig: int, frame: Any) -> None:  # called in the main thread by the signal
        self.signals += 1
        if self.signals >= 3:
            log.error("third signal: exiting now")
            logging.shutdown()
            os._exit(2)
        if self.signals == 2:
            self.cut_short = True
            threading.Thread(target=self._cut, name="preheat-cut-drain", daemon=True).start()
            return
        in_flight = self.core.in_flight  # counted at the signal, before the drain starts running them
        self.core.begin_drain()
        log.warning("draining: %d prediction(s) in flight, grace %.0fs", in_flight, self.grace_s)
        threading.Thread(target=self._drain, name="preheat-drain", daemon=True).start()

    def _cut(self) -> None:
        """The second signal: fail what runs and what waits (their answers go out), then stop."""
        failed = self.core.abort_running() + self.core.queue_depth
        self.core.close(timeout=0.0, wait_pushes=False)
        log.warning("second signal: drain cut short; %d prediction(s) failed unfinished", failed)
        self.should_exit = True

    def _drain(self) -> None:
        self.drained = self.core.wait_idle(self.grace_s)
        if not self.drained:
            log.warning("grace period over; failing the predictions still waiting")
        self.core.close(timeout=1.0)
        self.should_exit = True


def serve(config: CoreConfig, *, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0,
          token: Optional[str] = None, log_level: str = "info", webhooks: WebhookPolicy = WebhookPolicy(),
          max_body_bytes: int = MAX_BODY_BYTES, header_timeout_s: float = HEADER_TIMEOUT_S,
          body_timeout_s: float = BODY_TIMEOUT_S, max_header_bytes: int = MAX_HEADER_BYTES,
          max_headers: int = MAX_HEADERS, announce: Callable[[str], None] = print,
          keep_alive_on_failure: bool = False) -> int:
    """Start the core (set-up in the background) and serve HTTP until a signal; returns 0, or 1
    when set-up failed. A set-up failure is announced in one line; the server then exits, or,
    with ``keep_alive_on_failure``, stays up answering SETUP_FAILED (as Cog does, for a platform
    that reads the health check)."""
    sock = bind_socket(host, port)
    core = Core(config).start()
    app = create_app(core, token=token, grace_s=grace_s, webhooks=webhooks, max_body_bytes=max_body_bytes,
                     body_timeout_s=body_timeout_s)
    uv_config = uvicorn_config(app, log_level=log_level, grace_s=grace_s, header_timeout_s=header_timeout_s,
                               max_header_bytes=max_header_bytes, max_headers=max_headers)
    server = DrainingServer(uv_config, core, grace_s)
    bound_host, bound_port = sock.getsockname()[:2]
    announce(f"preheat serve: listening on http://{bound_host}:{bound_port} (status: STARTING until warm-up ends)")

    def setup_finished() -> None:  # the worker thread, once set-up has ended either way
        if core.setup.status != "failed":
            return
        announce(f"error: set-up failed: {core.setup.error}"
                 + ("; staying up (--keep-alive-on-failure): /health-check says SETUP_FAILED"
                    if keep_alive_on_failure else ""))
        if not keep_alive_on_failure:
            server.should_exit = True

    core.on_setup(setup_finished)
    server.run(sockets=[sock])
    if server.cut_short:
        # the engine call still running is not waited for: leave now, before the interpreter's
        # teardown could meet it (what made a second signal an abort)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if not core.draining:  # stopped without a signal (e.g. lifespan failure)
        core.close(timeout=1.0)
    return 1 if core.setup.status == "failed" else 0
