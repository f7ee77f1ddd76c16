"""A compile cache shared by a fleet (issue 8), end to end with JAX: fresh pods pull verified,
signed entries from a real S3-compatible server (moto on 127.0.0.1, real s3fs over HTTP) or a
shared folder; bad entries are refused and recompiled to the same image; racing pods leave one
verifying entry; a dead store costs one bounded timeout.

Every JAX compile and load runs in a child process ("a pod"), never in the pytest process: that is
what a fleet does, and it keeps compiled programs out of the test process (an earlier full-mode
compile in the same process breaks test_compile_cache's fault tests; see the report of issue 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import preheat
from preheat.cache.remote import open_store
from tests._support.s3_server import free_port, s3_server
from tests._support.reference import save_tiny_pipeline

CALL = dict(n=2, steps=3, sampler="euler", seed=7, class_labels=[1, 2])
SIGNING_KEY = "fleet-secret-" + "0123456789abcdef" * 2
REPO = Path(__file__).resolve().parents[2]
_OUR_VARS = ("PREHEAT_CACHE_URL", "PREHEAT_CACHE_SIGNING_KEY", "PREHEAT_TRUST_REMOTE_CACHE",
             "PREHEAT_CACHE_REMOTE_TIMEOUT", "AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL")

CHILD = textwrap.dedent(f"""
    import json, sys
    import numpy as np, preheat
    p = preheat.load(sys.argv[1])
    out = p.generate(**{CALL!r})
    np.save(sys.argv[2], out)
    print("EVENT " + json.dumps(p.compiler.events[-1]))
""")

# The same child, killed (SIGKILL) after its payload is uploaded and before its manifest is.
KILLED_BEFORE_MANIFEST = textwrap.dedent("""
    import os, signal
    from preheat.cache import remote
    real = remote.FsspecStore._put_bytes
    def put_bytes(self, data, rel):
        if rel.endswith("/manifest.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        real(self, data, rel)
    remote.FsspecStore._put_bytes = put_bytes
""") + CHILD


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("m") / "pipe")


@pytest.fixture(scope="module")
def reference_pixels(model_dir):
    return preheat.load(model_dir, cache="off").generate(**CALL)


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


@pytest.fixture
def s3_env(s3, monkeypatch):
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return s3


def _child(model_dir: Path, home: Path, out: Path, env: dict[str, str], script: str = CHILD,
           timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    base = {k: v for k, v in os.environ.items() if k not in _OUR_VARS}
    proc = subprocess.run([sys.executable, "-c", script, str(model_dir), str(out)], cwd=REPO, timeout=timeout,
                          env={**base, "PREHEAT_HOME": str(home), **env}, capture_output=True, text=True)
    events = [json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("EVENT ")]
    return proc, (events[-1] if events else {})


def _fleet_env(s3, bucket: str) -> dict[str, str]:
    return {**s3.env(), "PREHEAT_CACHE_URL": f"s3://{bucket}/fleet", "PREHEAT_CACHE_SIGNING_KEY": SIGNING_KEY}


def _store(url: str, **kw):
    kw.setdefault("signing_key", SIGNING_KEY.encode())
    kw.setdefault("timeout", 5.0)
    return open_store(url, **kw)


def test_fresh_pod_pulls_from_s3_and_reports_an_aot_remote_hit(model_dir, reference_pixels, s3_env, good_entry,
                                                              tmp_path):
    """The entry a pod compiled (``good_entry``), signed and pushed to the bucket as a pod pushes it (a
    pod's own miss and push on S3: test_pod_killed_before_its_manifest_leaves_nothing_accepted's second
    pod); a fresh pod pulls it and draws the same image without tracing."""
    bucket = s3_env.new_bucket()
    writer = _store(f"s3://{bucket}/fleet")
    writer.push("jax", good_entry)
    assert writer.last == "pushed"
    b, event_b = _child(model_dir, tmp_path / "pod-b", tmp_path / "b.npy", _fleet_env(s3_env, bucket))
    assert b.returncode == 0, b.stderr[-3000:]
    assert event_b["layer"] == "aot" and event_b["remote"] == "hit" and event_b["trace_lower_s"] == 0.0, event_b
    assert "remote_push" not in event_b
    assert event_b["key"] == good_entry.name
    assert np.array_equal(np.load(tmp_path / "b.npy"), reference_pixels)
    from preheat.cache.manage import verify_entries

    assert [i.ok for i in verify_entries(tmp_path / "pod-b")] == [True]  # published locally, verifying


def test_shared_folder_store_works_too(model_dir, reference_pixels, tmp_path):
    env = {"PREHEAT_CACHE_URL": str(tmp_path / "network-volume" / "preheat"), "PREHEAT_TRUST_REMOTE_CACHE": "1"}
    a, event_a = _child(model_dir, tmp_path / "pod-a", tmp_path / "a.npy", env)
    assert a.returncode == 0 and event_a["remote_push"] == "pushed", a.stderr[-3000:]
    b, event_b = _child(model_dir, tmp_path / "pod-b", tmp_path / "b.npy", env)
    assert b.returncode == 0, b.stderr[-3000:]
    assert event_b["layer"] == "aot" and event_b["remote"] == "hit", event_b
    assert np.array_equal(np.load(tmp_path / "b.npy"), reference_pixels)
    assert not list((tmp_path / "network-volume").rglob(".tmp-*"))  # every write was renamed into place


@pytest.fixture(scope="module")
def good_entry(model_dir, tmp_path_factory):
    """A verified local entry for CALL (compiled once, in a child, no store) to seed stores with."""
    root = tmp_path_factory.mktemp("good")
    proc, event = _child(model_dir, root, root / "out.npy", {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "compile" / "jax" / event["key"]


def _tamper_manifest(store, key):
    m = json.loads(store._read(f"compile/jax/{key}/manifest.json"))
    m["created"] += 1  # any change after signing
    store._put_bytes(json.dumps(m).encode(), f"compile/jax/{key}/manifest.json")


def _tamper_payload(store, key):
    m = json.loads(store._read(f"compile/jax/{key}/manifest.json"))
    sha = m["files"]["executable.bin"]["sha256"]
    data = bytearray(store._read(f"compile/jax/{key}/objects/{sha}"))
    data[len(data) // 2] ^= 0x10
    store._put_bytes(bytes(data), f"compile/jax/{key}/objects/{sha}")


CASES = {"tampered-manifest": (True, _tamper_manifest), "tampered-payload": (True, _tamper_payload),
         "unsigned": (False, None)}


# make test: the tampered payload end to end; the other refusals there in test-slow, and each cheaply in test_remote_store
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "tampered-payload" else pytest.mark.slow) for c in CASES])
def test_bad_remote_entry_is_refused_logged_recompiled_same_image(model_dir, reference_pixels, s3_env, good_entry,
                                                                 tmp_path, case):
    signed, tamper = CASES[case]
    bucket = s3_env.new_bucket()
    url = f"s3://{bucket}/fleet"
    writer = _store(url) if signed else _store(url, signing_key=None, trust=True)
    writer.push("jax", good_entry)
    assert writer.last == "pushed"
    if tamper:
        tamper(writer, good_entry.name)
    proc, event = _child(model_dir, tmp_path / "pod", tmp_path / "out.npy", _fleet_env(s3_env, bucket))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.array_equal(np.load(tmp_path / "out.npy"), reference_pixels)
    assert event["remote"].startswith("refused") and event["layer"] != "aot", event
    assert "refused" in proc.stderr and good_entry.name[:12] in proc.stderr  # logged
    assert event["remote_push"] == "pushed"  # the recompiled, signed entry replaced the bad one
    assert _store(url).verify() == [{"kind": "jax", "key": good_entry.name, "ok": True, "problem": ""}]


BROKEN_LOAD = textwrap.dedent("""
    import preheat.cache.serialized as se
    def broken(*a, **k):
        raise RuntimeError("simulated: this executable does not load here")
    se.load_executable = broken
""") + CHILD


def test_pulled_entry_that_fails_to_load_is_replaced(model_dir, reference_pixels, s3_env, good_entry, tmp_path):
    bucket = s3_env.new_bucket()
    _store(f"s3://{bucket}/fleet").push("jax", good_entry)
    proc, event = _child(model_dir, tmp_path / "pod", tmp_path / "out.npy", _fleet_env(s3_env, bucket),
                         script=BROKEN_LOAD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.array_equal(np.load(tmp_path / "out.npy"), reference_pixels)
    assert event["remote"] == "hit" and "quarantined" in event and event["remote_push"] == "pushed", event


@pytest.mark.slow
def test_six_pods_on_empty_roots_race_against_one_empty_store(model_dir, reference_pixels, s3_env, tmp_path):
    s3 = s3_env
    bucket = s3.new_bucket()
    env = _fleet_env(s3, bucket)
    base = {k: v for k, v in os.environ.items() if k not in _OUR_VARS}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(model_dir), str(tmp_path / f"out{i}.npy")], cwd=REPO,
                              env={**base, "PREHEAT_HOME": str(tmp_path / f"pod{i}"), **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(6)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, [r[1][-2000:] for r in results]
    events = [json.loads(line[6:]) for out, _ in results for line in out.splitlines() if line.startswith("EVENT ")]
    assert len(events) == 6
    assert all(e["remote"] in ("miss", "hit") for e in events), events
    assert all(e.get("remote_push", "exists") in ("pushed", "exists") for e in events), events
    for i in range(6):
        assert np.array_equal(np.load(tmp_path / f"out{i}.npy"), reference_pixels)
    report = _store(f"s3://{bucket}/fleet").verify()
    assert report == [{"kind": "jax", "key": events[0]["key"], "ok": True, "problem": ""}], report


def test_pod_killed_before_its_manifest_leaves_nothing_accepted(model_dir, reference_pixels, s3_env, tmp_path):
    bucket = s3_env.new_bucket()
    env = _fleet_env(s3_env, bucket)
    killed, _ = _child(model_dir, tmp_path / "pod-a", tmp_path / "a.npy", env, script=KILLED_BEFORE_MANIFEST)
    assert killed.returncode == -9, killed.stderr[-3000:]
    store = _store(f"s3://{bucket}/fleet")
    [row] = store.verify()
    assert not row["ok"] and "no manifest" in row["problem"]  # the payload is there, the entry is not
    proc, event = _child(model_dir, tmp_path / "pod-b", tmp_path / "b.npy", env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.array_equal(np.load(tmp_path / "b.npy"), reference_pixels)
    assert event["remote"] == "miss" and event["layer"] != "aot" and event["remote_push"] == "pushed", event
    assert [r["ok"] for r in store.verify()] == [True]


def test_store_down_start_up_succeeds_within_the_timeout(model_dir, reference_pixels, tmp_path):
    timeout = 1.0
    env = {"PREHEAT_CACHE_URL": "s3://fleet/cache", "PREHEAT_CACHE_SIGNING_KEY": SIGNING_KEY,
           "PREHEAT_CACHE_REMOTE_TIMEOUT": str(timeout), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    proc, event = _child(model_dir, tmp_path / "pod", tmp_path / "out.npy", env)  # nothing listens on that port
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.array_equal(np.load(tmp_path / "out.npy"), reference_pixels)
    assert event["remote"].startswith("unreachable") and "unavailable" in proc.stderr, event
    assert event["remote_s"] < 2 * timeout + 0.5, event  # one bounded deadline ...
    assert event["remote_push"].startswith("unreachable") and event["remote_push_s"] < timeout, event  # ... then skipped (no second deadline)
    assert [p.name for p in (tmp_path / "pod" / "compile" / "jax").iterdir()] == [event["key"]]  # local cache works
