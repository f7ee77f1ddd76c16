"""`prune_remote` under a concurrent reader, on a moto S3 bucket and on a shared folder.

The reader is held between reading a manifest and downloading its payload (a gate, not a
timing window); the prune's clock is passed in (``now``), so "an hour later" needs no sleep.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import pytest
from click.testing import CliRunner

from preheat.cache.entries import checked_entry, publish_entry
from preheat.cache.remote import FsspecStore, LocalDirStore
from preheat.cli import main
from tests._support.gated import Gated
from tests._support.s3_server import s3_server

A, B = "aa" * 16, "bb" * 16


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


class GatedGets(Gated):
    """Downloads of payload objects are held: a reader stopped mid-pull."""

    def _get_file(self, rel, local):
        self.hold()
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


# ------------------------------------------------------------------ orphans: compile objects, weight blobs


def test_an_overwritten_manifest_leaves_objects_that_prune_collects(stores, tmp_path):
    """A second pod replaces the manifest of a key (two pods racing to push, or one that refused
    the entry); the first payload is then an orphan."""
    store, _ = stores
    for n, payload in enumerate((b"first writer" * 50, b"second writer" * 70)):
        kind_dir = tmp_path / f"pod{n}" / "compile" / "jax"
        publish_entry(kind_dir, A, {"executable.bin": payload}, {"schema": 1})
        pod = type(store)(store.url, trust=True)
        pod._refused.add(("jax", A))  # as if its check of the existing manifest had failed
        pod.push("jax", kind_dir / A)
        assert pod.last == "pushed"
    start = time.time()
    assert len(store._files(f"compile/jax/{A}/objects")) == 2
    young = store.prune_remote(protect_s=600, now=start + 60)
    assert young["deleted_objects"] == 0 and len(store._files(f"compile/jax/{A}/objects")) == 2
    old = store.prune_remote(protect_s=600, now=start + 7200)
    assert old["retired"] == [] and old["deleted_objects"] == 1 and old["freed_bytes"] == len(b"first writer" * 50)
    assert store.fetch("jax", A, tmp_path / "reader" / "jax") is True  # the live entry is whole
    assert (tmp_path / "reader" / "jax" / A / "executable.bin").read_bytes() == b"second writer" * 70
    _manifests_have_payloads(store)


def _blob(tmp_path, text: str) -> tuple[str, object]:
    data = text.encode() * 1000
    path = tmp_path / f"{text}.bin"
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest(), path


def _refs_have_blobs(store) -> None:
    """The invariant: every blob a remote ref names is in the store."""
    for name in store._files("refs"):
        for sha in json.loads(store._read(f"refs/{name}"))["blobs"]:
            assert store._exists(f"blobs/{sha}"), (name, sha)


def test_prune_collects_old_unreferenced_blobs_only(stores, tmp_path):
    store, _ = stores
    kept, kept_path = _blob(tmp_path, "kept")
    replaced, replaced_path = _blob(tmp_path, "replaced")
    current, current_path = _blob(tmp_path, "current")
    stray, stray_path = _blob(tmp_path, "stray")
    start = time.time()
    assert store.prune_remote(protect_s=600, now=start)["blobs_skipped"].startswith("no refs")
    store.mirror_put(kept, kept_path, ref="url-a-0123456789abcdef", source="https://a/k.safetensors")
    store.mirror_put(replaced, replaced_path, ref="url-b-0123456789abcdef", source="https://b/w.safetensors")
    store.mirror_put(current, current_path, ref="url-b-0123456789abcdef", source="https://b/w.safetensors")
    store.mirror_put(stray, stray_path)  # a pod killed before its ref: nothing names it
    assert store.last == "pushed"
    assert set(store._files("blobs")) == {kept, replaced, current, stray}
    _refs_have_blobs(store)

    young = store.prune_remote(protect_s=600, now=start + 60)  # their refs may still be on their way
    assert young["deleted_blobs"] == 0 and set(store._files("blobs")) == {kept, replaced, current, stray}
    dry = store.prune_remote(protect_s=600, now=start + 7200, dry_run=True)
    assert dry["deleted_blobs"] == 2 and len(store._files("blobs")) == 4
    old = store.prune_remote(protect_s=600, now=start + 7200)
    assert old["deleted_blobs"] == 2 and old["freed_bytes"] == len(b"replaced" * 1000) + len(b"stray" * 1000)
    assert set(store._files("blobs")) == {kept, current}
    _refs_have_blobs(store)

    store._put_bytes(b"{garbage", "refs/url-c-0123456789abcdef.json")  # what it names is unknown
    store.mirror_put(stray, stray_path)
    stopped = store.prune_remote(protect_s=600, now=start + 7200)
    assert stopped["deleted_blobs"] == 0 and "unreadable" in stopped["blobs_skipped"] and store._exists(f"blobs/{stray}")


class GatedRefs(Gated):
    """A pod whose ref write is held (after its blob step)."""

    def _put_bytes(self, data, rel):
        if rel.startswith("refs/"):
            self.hold()
        super()._put_bytes(data, rel)


class GatedRefsFolder(GatedRefs, LocalDirStore):
    pass


class GatedRefsS3(GatedRefs, FsspecStore):
    pass


@pytest.mark.parametrize("found_in_store", [False, True], ids=["uploads-it", "finds-it-old-and-unnamed"])
def test_a_pod_mirroring_during_a_prune_never_leaves_a_ref_without_its_blob(stores, tmp_path, found_in_store):
    """The pod is held between its blob step and its ref write while a prune runs: a blob it just
    uploaded is young and stays; an old unnamed blob it found is deleted, and the pod puts it back."""
    store, _ = stores
    pod = (GatedRefsS3 if isinstance(store, FsspecStore) else GatedRefsFolder)(store.url, trust=True, timeout=60)
    sha, path = _blob(tmp_path, "weights")
    start = time.time()
    if found_in_store:
        store.mirror_put(sha, path)  # left by a pod killed before its ref (or a ref since replaced)
    store.mirror_put(*_blob(tmp_path, "other"), ref="url-o-0123456789abcdef")  # some ref exists
    status: dict = {}

    def mirror() -> None:
        pod.mirror_put(sha, path, ref="url-w-0123456789abcdef")
        status["last"] = pod.last  # per thread

    worker = threading.Thread(target=mirror)
    worker.start()
    assert pod.entered.wait(120)
    # "an hour later" for the blob that was already there; "a minute later" for one just uploaded
    result = store.prune_remote(protect_s=600, now=start + (7200 if found_in_store else 60))
    assert result["deleted_blobs"] == (1 if found_in_store else 0)
    pod.gate.set()
    worker.join(120)
    assert status == {"last": "pushed"}  # uploaded (again, when the prune took it)
    _refs_have_blobs(store)
    reader = type(store)(store.url, trust=True)
    assert reader.mirror_get(sha, tmp_path / "got") is True and (tmp_path / "got").read_bytes() == path.read_bytes()
    assert store.prune_remote(protect_s=600, now=start + 7200)["deleted_blobs"] == 0  # named now: stays


def test_a_pull_records_its_ref_and_the_cli_reports_blobs(tmp_path, monkeypatch):
    from preheat.store import pull
    from preheat.store._layout import parse_source
    from tests._support.file_server import FileServer

    data = b"weights" * 3000
    sha = hashlib.sha256(data).hexdigest()
    shared = tmp_path / "store"
    monkeypatch.setenv("PREHEAT_CACHE_URL", str(shared))
    srv = FileServer().start()
    try:
        srv.files["/w.safetensors?token=secret"] = data
        url = srv.url("w.safetensors?token=secret")
        pull(url, root=tmp_path / "home", progress=False)
    finally:
        srv.stop()
    ref = json.loads((shared / "refs" / f"{parse_source(url).id}.json").read_bytes())
    assert ref["blobs"] == [sha] and "secret" not in ref["source"] and (shared / "blobs" / sha).is_file()
    out = CliRunner().invoke(main, ["cache", "prune", "--remote"])
    assert out.exit_code == 0 and "deleted 0 objects and 0 unreferenced weight blobs" in out.output, out.output
