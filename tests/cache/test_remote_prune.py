"""`prune_remote` under a concurrent reader, on a moto S3 bucket and on a shared folder.

The reader is held between reading a manifest and downloading its payload (a gate, not a
timing window); the prune's clock is passed in (``now``), so "an hour later" needs no sleep.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from click.testing import CliRunner

from preheat.cache.entries import checked_entry, publish_entry
from preheat.cache.remote import FsspecStore, LocalDirStore
from preheat.cli import main
from tests.cache.s3_server import s3_server

A, B = "aa" * 16, "bb" * 16


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


class GatedGets:
    """Downloads of payload objects wait for ``gate``; ``entered`` says a reader got that far."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _get_file(self, rel, local):
        self.entered.set()
        assert self.gate.wait(120), "the test never opened the gate"
        super()._get_file(rel, local)


class GatedFolder(GatedGets, LocalDirStore):
    pass


class GatedS3(GatedGets, FsspecStore):
    pass


@pytest.fixture(params=["s3", "folder"])
def stores(request, tmp_path, monkeypatch):
    """(the pruning pod's store, a reading pod's gated store), both on one fresh store."""
    if request.param == "s3":
        server = request.getfixturevalue("s3")
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        url = f"s3://{server.new_bucket()}/fleet"
        return FsspecStore(url, trust=True), GatedS3(url, trust=True, timeout=60)
    path = tmp_path / "store"
    return LocalDirStore(path, trust=True), GatedFolder(path, trust=True, timeout=60)


def _manifests_have_payloads(store) -> None:
    """The invariant: every entry the store shows (has a manifest for) verifies completely."""
    for row in store.verify("jax"):
        assert row["ok"] or row["problem"].startswith("no manifest"), row


def test_prune_never_leaves_a_reader_with_a_manifest_whose_payload_is_gone(stores, tmp_path):
    store, reader = stores
    kind_dir = tmp_path / "writer" / "compile" / "jax"
    for key, size in ((A, 1000), (B, 3000)):
        publish_entry(kind_dir, key, {"executable.bin": bytes([size % 251]) * size}, {"schema": 1})
        store.push("jax", kind_dir / key)
        assert store.last == "pushed"
    start = time.time()

    # just published: protected from the size cap and the age limit alike
    fresh = store.prune_remote(max_bytes=0, older_than_s=0, protect_s=600, now=start + 60)
    assert fresh["retired"] == [] and sorted(fresh["kept_protected"]) == [A, B]
    assert store.has("jax", A) and store.has("jax", B)

    # a reader has read A's manifest and is about to download its payload ...
    got: dict = {}
    worker = threading.Thread(target=lambda: got.update(hit=reader.fetch("jax", A, tmp_path / "reader" / "jax"),
                                                         last=reader.last))
    worker.start()
    assert reader.entered.wait(120)
    # ... when, two hours later, a prune retires everything over an age limit of one hour
    later = start + 7200
    result = store.prune_remote(older_than_s=3600, protect_s=600, now=later)
    assert sorted(result["retired"]) == [A, B] and result["deleted_objects"] == 0
    assert not store.has("jax", A)  # new readers miss ...
    _manifests_have_payloads(store)
    reader.gate.set()
    worker.join(120)
    assert got == {"hit": True, "last": "hit"}  # ... the one in flight still gets the whole entry
    assert checked_entry(tmp_path / "reader" / "jax", A) is not None

    newcomer = type(store)(store.url, trust=True)  # a reader that comes later sees a plain miss
    assert newcomer.fetch("jax", A, tmp_path / "reader2") is False and newcomer.last == "miss"

    # the retirement is itself older than the window at the next run: the payloads go
    collected = store.prune_remote(older_than_s=3600, protect_s=600, now=later + 7200)
    assert collected["deleted_objects"] == 2 and collected["freed_bytes"] == 4000
    assert store._files(f"compile/jax/{A}/objects") == {} and store._files(f"compile/jax/{A}") == {}
    _manifests_have_payloads(store)


def test_size_cap_retires_the_oldest_first_and_the_cli_runs_it(tmp_path, monkeypatch):
    path = tmp_path / "store"
    store = LocalDirStore(path, trust=True)
    kind_dir = tmp_path / "writer" / "compile" / "jax"
    for key in (A, B):
        publish_entry(kind_dir, key, {"executable.bin": key.encode() * 100}, {"schema": 1})
        store.push("jax", kind_dir / key)
    old = time.time() - 3 * 3600  # A was published three hours ago, B two
    os.utime(path / "compile" / "jax" / A / "manifest.json", (old, old))
    os.utime(path / "compile" / "jax" / B / "manifest.json", (old + 3600, old + 3600))
    for obj in (path / "compile" / "jax").glob("*/objects/*"):
        os.utime(obj, (old, old))
    monkeypatch.setenv("PREHEAT_CACHE_URL", str(path))
    dry = CliRunner().invoke(main, ["cache", "prune", "--remote", "--max-gb", str(4000 / 1024**3), "--dry-run"])
    assert dry.exit_code == 0 and dry.output.startswith("would retire 1 entries"), dry.output
    assert store.has("jax", A)
    out = CliRunner().invoke(main, ["cache", "prune", "--remote", "--max-gb", str(4000 / 1024**3)])
    assert out.exit_code == 0 and out.output.startswith("retired 1 entries"), out.output
    assert not store.has("jax", A) and store.has("jax", B)  # the oldest went, the cap is met
    bad = CliRunner().invoke(main, ["cache", "prune", "--max-gb", "1"])
    assert bad.exit_code == 2 and "apply to --remote" in bad.output
