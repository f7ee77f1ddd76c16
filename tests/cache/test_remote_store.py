"""The remote store protocol without JAX: signing, validation, atomic pushes, races, dead stores,
the weights mirror. S3 tests talk HTTP to a real moto server on 127.0.0.1 with the real s3fs."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from preheat.cache import remote as remote_mod
from preheat.cache.entries import open_entry, publish_entry
from preheat.cache.remote import LocalDirStore, open_store
from preheat.cache.signing import SignatureError, canonical, sign, verify
from preheat.errors import InvalidArgumentError
from tests._support.s3_server import free_port, s3_server

KEY = "ab" * 16
SIGNING_KEY = b"k" * 32
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture(params=["s3", "folder"])
def store_url(request, tmp_path, monkeypatch):
    """A fresh, empty store of each kind: an S3 bucket on moto, or a shared folder."""
    if request.param == "s3":
        server = request.getfixturevalue("s3")
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        return f"s3://{server.new_bucket()}/fleet"
    return str(tmp_path / "shared")


def _entry(kind_dir: Path, payload: bytes = b"executable bytes", key: str = KEY) -> Path:
    entry, won = publish_entry(kind_dir, key, {"executable.bin": payload}, {"f": 1})
    assert won
    return entry.path


def _store(url: str, **kw):
    kw.setdefault("signing_key", SIGNING_KEY)
    kw.setdefault("timeout", 3.0)
    return open_store(url, **kw)


# --------------------------------------------------------------------------------------- signing


def test_signature_round_trip_and_refusals():
    m = {"schema": 1, "kind": "jax", "key": KEY, "files": {"a": {"sha256": "0" * 64, "size": 1}}, "created": 1.5}
    signed = sign(m, SIGNING_KEY)
    verify(signed, SIGNING_KEY)
    assert canonical(signed) == canonical(m)  # the signature field is not part of what is signed
    with pytest.raises(SignatureError, match="unsigned"):
        verify(m, SIGNING_KEY)
    with pytest.raises(SignatureError, match="another key"):
        verify(signed, b"z" * 32)
    changed = json.loads(json.dumps(signed))
    changed["files"]["a"]["sha256"] = "1" * 64
    with pytest.raises(SignatureError, match="does not verify"):
        verify(changed, SIGNING_KEY)
    moved = {**signed, "key": "cd" * 16}  # a signed manifest copied under another key
    with pytest.raises(SignatureError):
        verify(moved, SIGNING_KEY)


# --------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("key", ["../../etc/passwd", "AB" * 16, "ab" * 15, "ab" * 16 + "/..", "", "a" * 64, "..",
                                 "ab" * 15 + "/x"])
def test_path_traversal_keys_are_refused(tmp_path, key):
    store = _store(str(tmp_path / "shared"))
    with pytest.raises(InvalidArgumentError):
        store.fetch("jax", key, tmp_path / "local")
    with pytest.raises(InvalidArgumentError):
        store.push("jax", tmp_path / "local" / key)
    with pytest.raises(InvalidArgumentError):
        store.fetch("../jax", KEY, tmp_path / "local")
    if key != "a" * 64:  # 64 hex digits are a valid blob name (but not a compile key)
        with pytest.raises(InvalidArgumentError):
            store.mirror_get(key, tmp_path / "blob")
    assert not (tmp_path / "local").exists() and not (tmp_path / "shared").exists()


@pytest.mark.parametrize("bad", [
    {"files": {"../../escape": {"sha256": "0" * 64, "size": 1}}},
    {"files": {"sub/dir": {"sha256": "0" * 64, "size": 1}}},
    {"files": {".hidden": {"sha256": "0" * 64, "size": 1}}},
    {"files": {"manifest.json": {"sha256": "0" * 64, "size": 1}}},
    {"files": {"executable.bin": {"sha256": "../../../x" + "0" * 54, "size": 1}}},
    {"files": {"executable.bin": {"sha256": "0" * 64, "size": -1}}},
    {"key": "cd" * 16},
    {"kind": "torch"},
    {"schema": 99},
])
def test_manifest_with_unsafe_names_or_fields_is_refused(tmp_path, bad, caplog):
    shared = tmp_path / "shared"
    manifest = {"schema": 1, "kind": "jax", "key": KEY, "fields": {}, "created": 0,
                "files": {"executable.bin": {"sha256": "0" * 64, "size": 1}}}
    manifest.update(bad)
    (shared / "compile" / "jax" / KEY).mkdir(parents=True)
    (shared / "compile" / "jax" / KEY / "manifest.json").write_text(json.dumps(sign(manifest, SIGNING_KEY)))
    store = _store(str(shared))
    with caplog.at_level(logging.WARNING, logger="preheat.cache"):
        assert store.fetch("jax", KEY, tmp_path / "local") is False
    assert store.last.startswith("refused"), store.last
    assert "refused" in caplog.text
    assert not (tmp_path / "local" / KEY).exists() and not (tmp_path / "escape").exists()
    local = tmp_path / "local"
    assert not local.exists() or [p.name for p in local.iterdir()] == []  # no temp folders left


@pytest.mark.parametrize("raw", [b"not json", b"[" * 100_000, b" " * (remote_mod.MAX_MANIFEST_BYTES + 10),
                                 b'{"schema": 1}'], ids=["not-json", "deep-nesting", "oversized", "no-files"])
def test_garbage_manifest_is_refused_without_raising(tmp_path, raw):
    shared = tmp_path / "shared"
    (shared / "compile" / "jax" / KEY).mkdir(parents=True)
    (shared / "compile" / "jax" / KEY / "manifest.json").write_bytes(raw)
    store = _store(str(shared))
    assert store.fetch("jax", KEY, tmp_path / "local") is False
    assert store.last.startswith("refused"), store.last


# --------------------------------------------------------------------------------------- round trip


def test_push_then_fetch_round_trip(store_url, tmp_path):
    a = _store(store_url)
    src = _entry(tmp_path / "a" / "compile" / "jax")
    a.push("jax", src)
    assert a.last == "pushed"
    b = _store(store_url)
    assert b.fetch("jax", KEY, tmp_path / "b") is True and b.last == "hit"
    entry = open_entry(tmp_path / "b", KEY, {"f": 1})
    assert entry.file("executable.bin").read_bytes() == b"executable bytes"
    assert entry.manifest["signature"]["alg"] == "hmac-sha256"
    a.push("jax", src)  # already there and verifying: nothing uploaded
    assert a.last == "exists"
    assert [r["ok"] for r in b.verify()] == [True]
    assert b.fetch("jax", "cd" * 16, tmp_path / "b") is False and b.last == "miss"


def test_without_key_or_trust_the_store_is_skipped_with_a_warning(tmp_path, caplog):
    shared = str(tmp_path / "shared")
    _store(shared).push("jax", _entry(tmp_path / "a" / "compile" / "jax"))
    untrusting = open_store(shared, signing_key=None, trust=False)
    with caplog.at_level(logging.WARNING, logger="preheat.cache"):
        assert untrusting.fetch("jax", KEY, tmp_path / "b") is False
    assert untrusting.last.startswith("disabled")
    assert "PREHEAT_CACHE_SIGNING_KEY" in caplog.text and "PREHEAT_TRUST_REMOTE_CACHE" in caplog.text
    trusting = open_store(shared, signing_key=None, trust=True)
    assert trusting.fetch("jax", KEY, tmp_path / "c") is True  # signed entries are fine to a trusting reader


def test_unsigned_entry_refused_when_a_key_is_set_and_replaced_by_the_next_push(tmp_path, caplog):
    shared = str(tmp_path / "shared")
    open_store(shared, signing_key=None, trust=True).push("jax", _entry(tmp_path / "a" / "compile" / "jax"))
    signed = _store(shared)
    with caplog.at_level(logging.WARNING, logger="preheat.cache"):
        assert signed.fetch("jax", KEY, tmp_path / "b") is False
    assert "unsigned" in signed.last and "unsigned" in caplog.text
    signed.push("jax", _entry(tmp_path / "b2" / "compile" / "jax"))
    assert signed.last == "pushed"
    assert _store(shared).fetch("jax", KEY, tmp_path / "c") is True


def test_env_configuration(tmp_path, monkeypatch):
    monkeypatch.delenv("PREHEAT_CACHE_URL", raising=False)
    assert remote_mod.remote_from_env() is None
    monkeypatch.setenv("PREHEAT_CACHE_URL", f"file://{tmp_path}/shared")
    monkeypatch.setenv("PREHEAT_CACHE_SIGNING_KEY", "s" * 32)
    monkeypatch.setenv("PREHEAT_CACHE_REMOTE_TIMEOUT", "1.5")
    store = remote_mod.remote_from_env()
    assert isinstance(store, LocalDirStore) and store.base == tmp_path / "shared"
    assert store.signing_key == b"s" * 32 and store.timeout == 1.5 and store.compile_policy() is None
    monkeypatch.setenv("PREHEAT_CACHE_REMOTE_TIMEOUT", "soon")
    with pytest.raises(InvalidArgumentError):
        remote_mod.remote_from_env()


# --------------------------------------------------------------------------------------- races


def test_racing_writers_with_different_payloads_leave_one_verifying_entry(store_url, tmp_path):
    """Serialized executables need not be byte-identical: six writers, six payloads, one key."""
    srcs = [_entry(tmp_path / f"w{i}" / "compile" / "jax", payload=f"payload of writer {i}".encode() * 1000)
            for i in range(6)]
    # seven clients at once against one local server: a generous hang bound, so a loaded CI box
    # (seen: load 12 on 2 cores) cannot turn a slow answer into a failed push
    stores = [_store(store_url, timeout=15.0) for _ in srcs]
    barrier = threading.Barrier(len(srcs))
    results = [""] * len(srcs)

    def write(i: int) -> None:
        barrier.wait()
        stores[i].push("jax", srcs[i])
        results[i] = stores[i].last  # ``last`` is per thread

    seen: list[str] = []
    stop = threading.Event()

    def read() -> None:  # readers during the race see a miss or a verified entry, never a torn one
        reader = _store(store_url, timeout=15.0)
        n = 0
        while not stop.is_set() and n < 200:
            n += 1
            reader.fetch("jax", KEY, tmp_path / "readers" / str(n))
            seen.append(reader.last)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(srcs))]
    watcher = threading.Thread(target=read)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    watcher.join(60)
    assert all(r in ("pushed", "exists") for r in results), results
    assert seen and set(seen) <= {"miss", "hit"}, set(seen)
    reader = _store(store_url)
    assert reader.verify() == [{"kind": "jax", "key": KEY, "ok": True, "problem": ""}]
    assert reader.fetch("jax", KEY, tmp_path / "r") is True
    got = (tmp_path / "r" / KEY / "executable.bin").read_bytes()
    assert got in {(s / "executable.bin").read_bytes() for s in srcs}


_KILLED_PUSH = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from preheat.cache import remote
    from preheat.cache.entries import publish_entry
    mode, url, local = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    entry, _ = publish_entry(local / "jax", "{key}", {{"executable.bin": b"x" * 300000}}, {{"f": 1}})
    base = remote.FsspecStore if url.startswith("s3://") else remote.LocalDirStore
    real_put_file = base._put_file
    if mode == "before-manifest":   # all payload uploaded, killed before the manifest goes up
        def put_bytes(self, data, rel):
            os.kill(os.getpid(), signal.SIGKILL)
        base._put_bytes = put_bytes
    else:                           # killed in the middle of the payload upload
        def put_file(self, local_file, rel):
            half = Path(str(local_file) + ".half")
            half.write_bytes(Path(local_file).read_bytes()[:1000])
            real_put_file(self, half, rel)  # a torn object where the payload should be
            os.kill(os.getpid(), signal.SIGKILL)
        base._put_file = put_file
    remote.open_store(url, signing_key=b"{skey}", timeout=5).push("jax", entry.path)
    print("push returned: the kill hook did not fire")
""").format(key=KEY, skey=SIGNING_KEY.decode())


@pytest.mark.parametrize("mode", ["before-manifest", "mid-payload"])
def test_push_killed_midway_leaves_nothing_readers_accept(store_url, tmp_path, mode):
    child = subprocess.run([sys.executable, "-c", _KILLED_PUSH, mode, store_url, str(tmp_path / "w")],
                           env={**os.environ}, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert child.returncode == -9, child.stdout + child.stderr
    reader = _store(store_url)
    assert reader.fetch("jax", KEY, tmp_path / "r") is False and reader.last == "miss"
    assert not (tmp_path / "r" / KEY).exists()
    assert reader.verify() == [{"kind": "jax", "key": KEY, "ok": False,
                                "problem": "no manifest (an unfinished or interrupted push)"}]
    # A later complete push repairs it.
    reader.push("jax", _entry(tmp_path / "r2" / "compile" / "jax"))
    assert reader.last == "pushed" and [r["ok"] for r in reader.verify()] == [True]


# --------------------------------------------------------------------------------------- tampering


def _tamper_payload(store_url: str, tmp_path: Path) -> None:
    store = _store(store_url)
    m = json.loads(store._read(f"compile/jax/{KEY}/manifest.json"))
    sha = m["files"]["executable.bin"]["sha256"]
    store._put_bytes(b"EXECUTABLE BYTES", f"compile/jax/{KEY}/objects/{sha}")  # same size, other bytes


def _tamper_manifest(store_url: str, tmp_path: Path) -> None:
    store = _store(store_url)
    m = json.loads(store._read(f"compile/jax/{KEY}/manifest.json"))
    m["fields"]["f"] = 2
    store._put_bytes(json.dumps(m).encode(), f"compile/jax/{KEY}/manifest.json")


@pytest.mark.parametrize("tamper", [_tamper_payload, _tamper_manifest], ids=["payload", "manifest"])
def test_tampered_entry_refused_logged_and_repaired_by_push(store_url, tmp_path, tamper, caplog):
    _store(store_url).push("jax", _entry(tmp_path / "a" / "compile" / "jax"))
    tamper(store_url, tmp_path)
    b = _store(store_url)
    with caplog.at_level(logging.WARNING, logger="preheat.cache"):
        assert b.fetch("jax", KEY, tmp_path / "b") is False
    assert b.last.startswith("refused") and "refused" in caplog.text
    assert not (tmp_path / "b" / KEY).exists()
    assert [r["ok"] for r in b.verify()] == [False]
    b.push("jax", _entry(tmp_path / "b2" / "compile" / "jax"))  # the refused entry is replaced
    assert b.last == "pushed"
    assert [r["ok"] for r in b.verify()] == [True]
    assert _store(store_url).fetch("jax", KEY, tmp_path / "c") is True


# --------------------------------------------------------------------------------------- dead stores


def test_store_down_costs_one_bounded_timeout(tmp_path, monkeypatch, caplog):
    port = free_port()  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    store = _store("s3://nobucket/p", timeout=1.0)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="preheat.cache"):
        assert store.fetch("jax", KEY, tmp_path / "l") is False
    assert time.monotonic() - start < 30  # bounded (an unbounded client retries for minutes)
    assert store.last.startswith("unreachable") and "unavailable" in caplog.text

    def no_io(*args, **kwargs):
        raise AssertionError("the store was contacted during its cool-down")

    monkeypatch.setattr(store, "_bounded", no_io)
    store.push("jax", _entry(tmp_path / "a" / "compile" / "jax"))  # skipped without I/O (cool-down)
    assert store.last.startswith("unreachable")


def test_store_that_accepts_but_never_answers_is_bounded(tmp_path, monkeypatch):
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(16)  # connections complete (kernel backlog) but nothing is ever read or answered
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{sink.getsockname()[1]}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        store = _store("s3://nobucket/p", timeout=1.0)
        start = time.monotonic()
        assert store.fetch("jax", KEY, tmp_path / "l") is False
        assert store.last.startswith("unreachable")
        assert time.monotonic() - start < 30  # bounded: without the deadline this would wait forever
    finally:
        sink.close()


def test_fsspec_config_endpoint_is_honoured(s3, tmp_path):
    """FSSPEC_S3_ENDPOINT_URL (fsspec's own config) works as well as AWS_ENDPOINT_URL."""
    bucket = s3.new_bucket()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT")}
    env.update({k: v for k, v in s3.env().items() if k != "AWS_ENDPOINT_URL"}, FSSPEC_S3_ENDPOINT_URL=s3.endpoint)
    script = textwrap.dedent(f"""
        from preheat.cache.remote import open_store
        s = open_store("s3://{bucket}/x", signing_key=None, trust=True, timeout=3)
        s._put_bytes(b"hi", "probe")
        print(s._read("probe"))
    """)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.stdout.strip() == "b'hi'", out.stderr[-2000:]


# --------------------------------------------------------------------------------------- weights mirror


def test_mirror_blobs_round_trip_and_verify(store_url, tmp_path, monkeypatch):
    data = os.urandom(200_000)
    sha = hashlib.sha256(data).hexdigest()
    (tmp_path / "w.safetensors").write_bytes(data)
    monkeypatch.setenv("PREHEAT_CACHE_URL", store_url)
    monkeypatch.delenv("PREHEAT_CACHE_SIGNING_KEY", raising=False)  # blobs need no trust setting
    assert remote_mod.mirror_get(sha, tmp_path / "got") is False  # empty store
    remote_mod.mirror_put(sha, tmp_path / "w.safetensors")
    assert remote_mod.default_store().last == "pushed"
    remote_mod.mirror_put(sha, tmp_path / "w.safetensors")
    assert remote_mod.default_store().last == "exists"
    assert remote_mod.mirror_get(sha, tmp_path / "got") is True
    assert (tmp_path / "got").read_bytes() == data
    with pytest.raises(InvalidArgumentError):
        remote_mod.mirror_put("0" * 64, tmp_path / "w.safetensors")  # name is not its sha256
    # A corrupted blob in the store is never handed out.
    remote_mod.default_store()._put_bytes(b"evil", f"blobs/{sha}")
    assert remote_mod.mirror_get(sha, tmp_path / "got2") is False and not (tmp_path / "got2").exists()
    assert [p.name for p in tmp_path.iterdir() if ".mirror-" in p.name] == []
    monkeypatch.delenv("PREHEAT_CACHE_URL")
    assert remote_mod.mirror_get(sha, tmp_path / "got3") is False  # no store: the caller downloads
