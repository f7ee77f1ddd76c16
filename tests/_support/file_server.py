"""A real HTTP file server on 127.0.0.1 for the store tests.

Serves in-memory files with ETag, ``Range: bytes=N-`` (206 / 416) and ``If-Range``, and can be
told to misbehave: ignore ranges (always 200), cut the connection after N body bytes (for the
next ``cut_times`` responses), throttle, or pause after N body bytes until released (so a client
can be killed at a known point). ``redirects`` maps a path to a 302's Location. Every request is
recorded.
"""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Hit:
    path: str
    range: str | None
    if_range: str | None
    status: int = 0
    sent: int = 0


class FileServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files: dict[str, bytes] = {}
        self.redirects: dict[str, str] = {}
        self.hits: list[Hit] = []
        self.lock = threading.Lock()
        self.support_range = True
        self.cut_after: int | None = None
        self.cut_times = 0
        self.chunk = 64 * 1024
        self.delay_s = 0.0
        self.pause_after: int | None = None
        self.release = threading.Event()
        self.paused = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}"

    def gets(self, path: str) -> list[Hit]:
        with self.lock:
            return [h for h in self.hits if h.path == "/" + path.lstrip("/")]

    def start(self) -> "FileServer":
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def handle_error(self, request, client_address) -> None:  # quiet about clients that went away
        pass


class _Handler(BaseHTTPRequestHandler):
    server: FileServer

    def log_message(self, format, *args) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:  # noqa: N802
        srv = self.server
        hit = Hit(self.path, self.headers.get("Range"), self.headers.get("If-Range"))
        with srv.lock:
            srv.hits.append(hit)
        if self.path in srv.redirects:
            hit.status = 302
            self.send_response(302)
            self.send_header("Location", srv.redirects[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = srv.files.get(self.path)
        if data is None:
            hit.status = 404
            self.send_error(404, "Not Found")
            return
        etag = '"' + hashlib.sha256(data).hexdigest()[:16] + '"'
        start, status = 0, 200
        m = re.match(r"^bytes=(\d+)-$", hit.range or "")
        if srv.support_range and m and (hit.if_range is None or hit.if_range == etag):
            start = int(m.group(1))
            if start >= len(data):
                hit.status = 416
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        body = data[start:]
        hit.status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", etag)
        if srv.support_range:
            self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        with srv.lock:
            cut = srv.cut_after if srv.cut_times > 0 else None
            if cut is not None:
                srv.cut_times -= 1
        pos = 0
        try:
            while pos < len(body):
                n = min(srv.chunk, len(body) - pos)
                if cut is not None:
                    n = min(n, cut - pos)
                if srv.pause_after is not None and pos < srv.pause_after:
                    n = min(n, srv.pause_after - pos)
                self.wfile.write(body[pos:pos + n])
                self.wfile.flush()
                pos += n
                hit.sent = pos
                if cut is not None and pos >= cut:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if srv.pause_after is not None and pos == srv.pause_after:
                    srv.paused.set()
                    srv.release.wait(timeout=30)
                if srv.delay_s:
                    time.sleep(srv.delay_s)
        except OSError:  # the client went away (killed)
            self.close_connection = True
