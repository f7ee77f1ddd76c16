"""A webhook receiver on 127.0.0.1 for the server tests: a real HTTP server recording what it is sent."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Receiver"]


class Receiver:
    """A tiny webhook receiver on 127.0.0.1 recording every JSON body POSTed to it."""

    def __init__(self) -> None:
        bodies: list[dict] = []
        cond = threading.Condition()
        self.bodies, self.cond = bodies, cond

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with cond:
                    bodies.append(data)
                    cond.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout: float = 60) -> list[dict]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.bodies) >= count, timeout), self.bodies
            return list(self.bodies)

    def wait_for(self, done: Any, timeout: float = 60) -> list[dict]:
        """Every body received once ``done(bodies)`` holds (e.g. the last one is the completed one)."""
        with self.cond:
            assert self.cond.wait_for(lambda: done(self.bodies), timeout), self.bodies
            return list(self.bodies)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
