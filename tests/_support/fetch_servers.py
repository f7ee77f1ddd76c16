"""Misbehaving HTTP servers on 127.0.0.1 for the guarded fetch's tests (``preheat.server.fetch``):
a tarpit (accepts, never answers), a slow drip, a body without ``Content-Length`` that never ends;
and what the store holds, to check that a refused fetch left nothing."""

from __future__ import annotations

import socket
import threading
from pathlib import Path


class RawServer:
    """A TCP server on ``host`` whose every connection is handed to ``serve(conn)`` in a thread
    (a tarpit: read nothing, answer nothing)."""

    def __init__(self, serve, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_server((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.serve, self.conns, self.accepted = serve, [], 0
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}/{path}"

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted += 1
            threading.Thread(target=self.serve, args=(conn, self.stopped), daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept(): a closed listener would still take connections
        except OSError:
            pass
        self.sock.close()
        for c in self.conns:
            c.close()


def tarpit(conn: socket.socket, stopped: threading.Event) -> None:
    stopped.wait(120)


def drip(conn: socket.socket, stopped: threading.Event) -> None:
    """Headers at once, then one byte of a 10 kB body every 0.1 s."""
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000\r\n\r\n")
    while not stopped.wait(0.1):
        try:
            conn.sendall(b"x")
        except OSError:
            return


def endless(conn: socket.socket, stopped: threading.Event) -> None:
    """A body with no Content-Length that never ends (HTTP/1.0 style: until the close)."""
    conn.recv(65536)
    try:
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: application/octet-stream\r\n\r\n")
        while not stopped.is_set():
            conn.sendall(b"\0" * 65536)
    except OSError:
        return


def stored_files(home: Path) -> set[str]:
    """Every file under the store but its lock files (taken by any pull, published or not)."""
    root = home / "models"
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.parent.name != "locks"}
