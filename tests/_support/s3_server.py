"""A real S3-compatible server on loopback for the remote-cache tests: moto's standalone server
(``moto_server``, from the ``moto[server]`` pip package) in a subprocess, reached over HTTP by the
real s3fs client. Nothing is mocked in-process; no network beyond 127.0.0.1.

``s3_server()`` yields an ``S3Server`` with its endpoint, a ``env()`` for child processes and
``new_bucket()``; each test uses its own bucket so tests do not see each other's entries.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moto_command() -> list[str]:
    exe = Path(sys.executable).with_name("moto_server")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("moto_server")
    if found:
        return [found]
    return [sys.executable, "-m", "moto.server"]


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen

    def env(self) -> dict[str, str]:
        """Variables that point s3fs at this server (the standard AWS ones)."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def new_bucket(self) -> str:
        import s3fs

        name = f"preheat-{uuid.uuid4().hex[:12]}"
        fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, key="testing", secret="testing",
                               skip_instance_cache=True)
        fs.mkdir(name)
        return name


@contextlib.contextmanager
def s3_server(timeout_s: float = 60.0) -> Iterator[S3Server]:
    last_err = ""
    for _attempt in range(3):  # a free port can be taken between probe and bind; try another
        port = free_port()
        env = {**os.environ, **CREDENTIALS}
        logf = tempfile.TemporaryFile()  # moto logs every request; a pipe nobody reads would block it
        proc = subprocess.Popen([*_moto_command(), "-H", "127.0.0.1", "-p", str(port)], env=env,
                                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).read()
                break
            except OSError:
                time.sleep(0.2)
        if proc.poll() is None and time.monotonic() < deadline:
            try:
                yield S3Server(endpoint, proc)
            finally:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
                logf.close()
            return
        logf.seek(0)
        last_err = logf.read().decode(errors="replace")[-500:] if proc.poll() is not None else "timed out"
        logf.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    raise RuntimeError(f"moto_server did not start: {last_err}")
