"""A stand-in for the Hugging Face Hub on 127.0.0.1: the routes ``huggingface_hub`` calls to list a
repository and download its files, over real HTTP. Point ``HF_ENDPOINT`` (``constants.ENDPOINT``)
at ``hub.base``.

* ``GET /api/models/{repo}/revision/{rev}``: the repository's info (``sha``, ``siblings``);
* ``GET /api/models/{repo}/tree/{rev}?recursive=...``: every file (path, size, oid, lfs);
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``: a file (``X-Repo-Commit``, ``ETag``, ``Content-Length``;
  a GET with ``Range: bytes=a-b`` gets that part, 206).

Each request is recorded (``hits``: method and path), so a test can assert which files' bodies
were sent and how many bytes. ``gated=True`` answers file downloads as a gated repository does to a
caller without access (401, ``X-Error-Code: GatedRepo``); its listing stays public, as the Hub's.
``pointed_at(monkeypatch, base)`` points this process's huggingface_hub at a stand-in.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit


class Hit(NamedTuple):
    method: str
    path: str  # the repository file for resolve requests, else the URL path
    sent: int  # body bytes sent


class FakeHub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, repo: str, files: dict[str, bytes], commit: str = "ab" * 20, gated: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repo, self.files, self.commit, self.gated = repo, files, commit, gated
        self.hits: list[Hit] = []
        self.lock = threading.Lock()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def downloaded(self) -> dict[str, int]:
        """Repository path -> body bytes sent by GET resolve requests."""
        with self.lock:
            return {h.path: h.sent for h in self.hits if h.method == "GET" and not h.path.startswith("/")}

    def start(self) -> "FakeHub":
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def pointed_at(monkeypatch: Any, base: str) -> None:
    """huggingface_hub in this process talks to ``base`` (a stand-in, or a closed port), online."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", base)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", base + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")


_LFS = (".safetensors", ".gguf")  # weight files: stored in LFS on the Hub (a sha256 ETag and oid)


def _etag(data: bytes, path: str) -> str:
    return hashlib.sha256(data).hexdigest() if path.endswith(_LFS) else hashlib.sha1(data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    server: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool, record: str) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(data)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(data)
        with self.server.lock:
            self.server.hits.append(Hit(self.command, record, len(data) if body else 0))

    def _serve(self, body: bool) -> None:
        hub = self.server
        url = urlsplit(self.path)
        path = unquote(url.path)
        repo = re.escape(hub.repo)
        info = re.fullmatch(rf"/api/models/{repo}(?:/revision/(?P<rev>[^/]+))?", path)
        tree = re.fullmatch(rf"/api/models/{repo}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?", path)
        resolve = re.fullmatch(rf"/{repo}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path)
        json_headers = {"Content-Type": "application/json"}
        if info and info["rev"] in (None, "main", hub.commit):
            doc = {"id": hub.repo, "sha": hub.commit, "private": False,
                   "siblings": [{"rfilename": p} for p in sorted(hub.files)]}
            return self._send(200, json.dumps(doc).encode(), json_headers, body, path)
        if tree and tree["rev"] in ("main", hub.commit):
            entries = []
            for p, data in sorted(hub.files.items()):
                entry = {"type": "file", "path": p, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                if p.endswith(_LFS):
                    entry["lfs"] = {"oid": _etag(data, p), "size": len(data), "pointerSize": 134}
                entries.append(entry)
            return self._send(200, json.dumps(entries).encode(), json_headers, body, path)
        if resolve and hub.gated:
            error = {"X-Error-Code": "GatedRepo", "X-Error-Message": f"Access to model {hub.repo} is restricted."}
            return self._send(401, b'{"error": "gated"}', {**json_headers, **error}, body, path)
        if resolve and resolve["rev"] in ("main", hub.commit) and resolve["file"] in hub.files:
            name = resolve["file"]
            data = hub.files[name]
            headers = {"X-Repo-Commit": hub.commit, "ETag": f'"{_etag(data, name)}"',
                       "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
            span = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            if span and body and int(span[1]) < len(data):  # a part of the file, as the Hub's CDN answers
                start, end = int(span[1]), min(int(span[2] or len(data) - 1), len(data) - 1)
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                return self._send(206, data[start:end + 1], headers, body, name)
            return self._send(200, data, headers, body, name)
        error = {"X-Error-Code": "RepoNotFound" if not (info or tree or resolve) else "EntryNotFound"}
        self._send(404, b'{"error": "not found"}', {**json_headers, **error}, body, path)
