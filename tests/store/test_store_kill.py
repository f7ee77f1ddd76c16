"""A pull killed with SIGKILL mid-download leaves only the partial download; the next pull resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from preheat.store import pull, resolve, verify_store
from preheat.store._http import partial_paths
from preheat.store._layout import Store
from tests._support.store_fixtures import files_of, tar_bytes

PULL = "import sys; from preheat.store import pull; pull(sys.argv[1], root=sys.argv[2], progress=False)"
PAUSE_AT = 100_000


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_kill_9_midway_then_resume(server, root, model):
    data = tar_bytes(model)
    assert len(data) > 2 * PAUSE_AT
    server.files["/big.tar.gz"] = data
    url = server.url("big.tar.gz")
    server.chunk = 8 * 1024
    server.pause_after = PAUSE_AT  # the server sends PAUSE_AT bytes, then holds the connection open

    proc = subprocess.Popen([sys.executable, "-c", PULL, url, str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        part, meta = partial_paths(Store(root), url)
        _wait(server.paused.is_set, 60, "the server to send the first bytes")
        _wait(lambda: part.exists() and part.stat().st_size == PAUSE_AT, 20, "the client to write them")
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    server.pause_after = None
    server.release.set()

    # nothing looks complete: no ref, no blob, no snapshot; only the partial download (+ its validators)
    models = root / "models"
    assert os.listdir(models / "refs") == []
    assert os.listdir(models / "blobs") == []
    assert os.listdir(models / "snapshots") == []
    assert sorted(os.listdir(models / "downloads")) == sorted([part.name, meta.name])
    assert part.stat().st_size == PAUSE_AT
    assert server.gets("big.tar.gz")[0].range is None

    # the next pull continues where the killed one stopped
    snap = pull(url, root=root, progress=False)
    last = server.gets("big.tar.gz")[-1]
    assert len(server.gets("big.tar.gz")) == 2
    assert last.range == f"bytes={PAUSE_AT}-" and last.status == 206 and last.sent == len(data) - PAUSE_AT
    assert files_of(snap) == files_of(model)
    assert verify_store(root) == []
    assert resolve(url, root=root, offline=True, verify=True) == snap
    assert os.listdir(models / "downloads") == []
