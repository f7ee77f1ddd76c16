"""http(s):// sources against a real local server: layout, dedup, resume, errors, CLI."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file

from preheat.errors import FetchError, InvalidArgumentError
from preheat.store import list_refs, pull, resolve, source_id, verify_store
from preheat.cli.pull import pull_command
from tests._support.store_fixtures import files_of, tar_bytes
from tests._support.terminal import run_on_terminal
from tests._support.timestamps import assert_utc_timestamp


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def listing(d):
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_pull_tarball_layout(server, root, model):
    server.files["/m/tiny.tar.gz"] = tar_bytes(model)
    url = server.url("m/tiny.tar.gz")
    snap = pull(url, root=root, progress=False)
    models = root / "models"
    want = files_of(model)

    # the snapshot is the diffusers folder (top-level "tiny-model/" stripped), byte for byte
    assert files_of(snap) == want
    assert snap.parent == models / "snapshots"
    listing_ids = sorted([p, sha(d)] for p, d in want.items())
    assert snap.name == sha(json.dumps(listing_ids, separators=(",", ":")).encode())

    # every snapshot file is a hardlink to blobs/<its sha256>, and nothing else is in blobs/
    for rel, data in want.items():
        blob = models / "blobs" / sha(data)
        assert blob.read_bytes() == data
        assert os.stat(snap / rel).st_ino == os.stat(blob).st_ino
    assert listing(models / "blobs") == sorted(sha(d) for d in want.values())

    # the ref names the source, the snapshot and each file; the download is gone
    ref_file = models / "refs" / source_id(url)
    ref = json.loads(ref_file.read_text())
    assert ref["source"] == url and ref["snapshot"] == snap.name and ref["kind"] == "tar"
    assert {f["path"]: f["sha256"] for f in ref["files"]} == {p: sha(d) for p, d in want.items()}
    assert ref["download_sha256"] == sha(server.files["/m/tiny.tar.gz"])
    assert_utc_timestamp(ref["created"])  # the one format the server's predictions use too
    assert listing(models / "downloads") == []
    assert [r.source for r in list_refs(root)] == [url]

    # readable as a diffusers folder
    from preheat.models.loading import resolve_unet_dir

    assert resolve_unet_dir(snap) == snap / "unet"
    tensors = load_file(str(snap / "unet" / "diffusion_pytorch_model.safetensors"))
    np.testing.assert_array_equal(tensors["conv_in.bias"], np.arange(8, dtype=np.float32))
    assert verify_store(root) == []


def test_second_pull_and_resolve_use_no_network(server, root, model):
    server.files["/tiny.tgz"] = tar_bytes(model)
    url = server.url("tiny.tgz")
    first = pull(url, root=root, progress=False)
    assert len(server.gets("tiny.tgz")) == 1
    assert pull(url, root=root, progress=False) == first
    assert resolve(url, root=root) == first
    assert len(server.gets("tiny.tgz")) == 1  # no second download

    server.stop()
    assert resolve(url, root=root) == first
    assert resolve(url, root=root, offline=True, verify=True) == first
    assert pull(url, root=root, progress=False) == first
    assert files_of(first) == files_of(model)


def test_resolve_pulls_when_missing_and_refuses_offline(server, root, model):
    server.files["/a.tar"] = tar_bytes(model, mode="w")
    url = server.url("a.tar")
    with pytest.raises(FetchError) as err:
        resolve(url, root=root, offline=True)
    assert "not in the store" in str(err.value) and "\n" not in str(err.value)
    assert server.gets("a.tar") == []
    snap = resolve(url, root=root, progress=False)
    assert files_of(snap) == files_of(model)
    assert len(server.gets("a.tar")) == 1


def test_cut_connection_resumes_with_range(server, root, model):
    data = tar_bytes(model)
    server.files["/cut.tar.gz"] = data
    server.chunk = 16 * 1024
    server.cut_after, server.cut_times = 50_000, 2  # the first two responses are cut short
    snap = pull(server.url("cut.tar.gz"), root=root, progress=False)
    hits = server.gets("cut.tar.gz")
    assert [h.status for h in hits] == [200, 206, 206]
    assert hits[0].range is None
    assert hits[1].range == "bytes=50000-" and hits[2].range == "bytes=100000-"
    assert hits[1].if_range is not None  # the ETag seen first guards the resume
    assert files_of(snap) == files_of(model)
    assert verify_store(root) == []


def test_server_without_range_support_restarts(server, root, model):
    server.files["/norange.tar.gz"] = tar_bytes(model)
    server.support_range = False
    server.cut_after, server.cut_times = 40_000, 1
    snap = pull(server.url("norange.tar.gz"), root=root, progress=False)
    hits = server.gets("norange.tar.gz")
    assert [h.status for h in hits] == [200, 200]
    assert hits[1].range == "bytes=40000-"  # asked to resume, got the whole file: started over
    assert files_of(snap) == files_of(model)


def test_cut_every_time_fails_and_keeps_partial_for_later(server, root, model, monkeypatch):
    monkeypatch.setattr("preheat.store._http.BACKOFF_S", 0.01)
    data = tar_bytes(model)
    server.files["/flaky.tar.gz"] = data
    server.support_range = False  # every attempt starts over and is cut at the same point: no progress
    server.cut_after, server.cut_times = 30_000, 100
    url = server.url("flaky.tar.gz")
    with pytest.raises(FetchError) as err:
        pull(url, root=root, progress=False)
    msg = str(err.value)
    # the first attempt made progress; then one attempt + 3 retries that made none, then give up
    assert len(server.gets("flaky.tar.gz")) == 5
    assert "\n" not in msg and "cut short" in msg and f"of {len(data)} bytes" in msg
    models = root / "models"
    assert listing(models / "refs") == [] and listing(models / "snapshots") == []
    assert [p for p in listing(models / "blobs")] == []
    assert [p for p in listing(models / "downloads") if p.endswith(".incomplete")]
    # the server recovers: the next pull resumes and completes
    server.support_range, server.cut_times = True, 0
    snap = pull(url, root=root, progress=False)
    assert server.gets("flaky.tar.gz")[-1].range == "bytes=30000-"
    assert files_of(snap) == files_of(model)


def test_404_is_one_line_fetch_error(server, root):
    with pytest.raises(FetchError) as err:
        pull(server.url("missing.tar.gz"), root=root, progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "404" in msg and "missing.tar.gz" in msg
    assert len(server.gets("missing.tar.gz")) == 1  # a 404 is not retried
    assert listing(root / "models" / "refs") == []


def test_connection_refused_is_one_line_fetch_error(server, root):
    url = server.url("x.tar.gz")
    server.stop()
    with pytest.raises(FetchError) as err:
        pull(url, root=root, progress=False)
    assert "\n" not in str(err.value) and "cannot download" in str(err.value)


def test_sha256_fragment_is_checked(server, root, model):
    data = tar_bytes(model)
    server.files["/s.tar.gz"] = data
    url = server.url("s.tar.gz")
    with pytest.raises(FetchError) as err:
        pull(url + "#sha256=" + "0" * 64, root=root, progress=False)
    assert "sha256 mismatch" in str(err.value) and "\n" not in str(err.value)
    models = root / "models"
    assert listing(models / "refs") == [] and listing(models / "downloads") == [] and listing(models / "blobs") == []
    snap = pull(url + "#sha256=" + sha(data), root=root, progress=False)
    assert files_of(snap) == files_of(model)
    with pytest.raises(InvalidArgumentError):
        pull(url + "#md5=abc", root=root, progress=False)


def test_single_file_url_is_a_one_file_snapshot(server, root, model):
    weights = (model / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    server.files["/w/diffusion_pytorch_model.safetensors"] = weights
    snap = pull(server.url("w/diffusion_pytorch_model.safetensors"), root=root, progress=False)
    assert files_of(snap) == {"diffusion_pytorch_model.safetensors": weights}
    blob = root / "models" / "blobs" / sha(weights)
    assert os.stat(blob).st_ino == os.stat(snap / "diffusion_pytorch_model.safetensors").st_ino
    assert listing(root / "models" / "downloads") == []
    assert verify_store(root) == []


def test_progress_bar_on_a_terminal_only(server, root, model, capfd):
    """On a terminal: bytes, rate and time left, on stderr; a pipe (here) gets none of it."""
    server.files["/p.tar.gz"] = tar_bytes(model)
    pull(server.url("p.tar.gz"), root=root, progress=True)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    server.files["/t.tar.gz"] = server.files["/p.tar.gz"]
    shown = run_on_terminal([sys.executable, "-m", "preheat", "pull", server.url("t.tar.gz")],
                            env={**os.environ, "PREHEAT_HOME": str(root)}, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert os.path.isdir(shown.stdout.strip())  # stdout: the snapshot folder only
    bar = shown.plain_stderr
    assert "t.tar.gz" in bar and re.search(r"[0-9.]+/[0-9.]+ [kMG]?B", bar) and re.search(r"[0-9.]+ [kMG]?B/s", bar)
    assert re.search(r"[0-9]+:[0-9]{2}:[0-9]{2}", bar)  # time left


def test_cli_pull_prints_path_and_one_line_errors(server, root, model, monkeypatch):
    monkeypatch.setenv("PREHEAT_HOME", str(root))
    server.files["/c.tar.gz"] = tar_bytes(model)
    runner = CliRunner()
    ok = runner.invoke(pull_command, [server.url("c.tar.gz"), "--quiet"])
    assert ok.exit_code == 0, ok.output
    path = ok.stdout.strip()
    assert path.startswith(str(root / "models" / "snapshots")) and files_of(__import__("pathlib").Path(path)) == files_of(model)

    bad = runner.invoke(pull_command, [server.url("nope.tar.gz"), "-q"])
    assert bad.exit_code == 1 and bad.stdout == ""
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1 and "404" in bad.stderr

    usage = runner.invoke(pull_command, ["hf://a/b@x", "--revision", "y"])
    assert usage.exit_code == 2 and usage.stderr.startswith("error: ") and "conflicting" in usage.stderr


def test_crash_after_download_before_publish_reuses_the_finished_download(server, root, model, monkeypatch):
    data = tar_bytes(model)
    server.files["/late.tar.gz"] = data
    url = server.url("late.tar.gz")

    def crash(*a, **k):
        raise RuntimeError("killed while extracting")

    monkeypatch.setattr("preheat.store._api.extract_tar", crash)
    with pytest.raises(RuntimeError):
        pull(url, root=root, progress=False)
    monkeypatch.undo()
    models = root / "models"
    assert listing(models / "refs") == [] and listing(models / "snapshots") == []
    snap = pull(url, root=root, progress=False)
    hits = server.gets("late.tar.gz")
    assert [(h.status, h.range, h.sent) for h in hits[1:]] == [(416, f"bytes={len(data)}-", 0)]  # nothing re-sent
    assert files_of(snap) == files_of(model)
    assert listing(models / "downloads") == []


def _only(*admitted: str):
    """An address check admitting ``admitted`` addresses only (as a server's policy would refuse
    loopback), recording every (host, address) it was asked about."""
    asked: list[tuple[str, str]] = []

    def check(host, ip):
        asked.append((host, str(ip)))
        if str(ip) not in admitted:
            raise FetchError(f"{host} ({ip}) is refused by the test's policy")

    return check, asked


def test_address_check_refuses_before_any_request_and_admits_what_it_allows(server, root):
    from preheat.store import address_check

    server.files["/l.safetensors"] = b"x" * 1000
    url = server.url("l.safetensors")
    refuse, asked = _only()
    with address_check(refuse), pytest.raises(FetchError, match=r"127\.0\.0\.1 \(127\.0\.0\.1\) is refused") as err:
        pull(url, root=root, progress=False)
    assert "\n" not in str(err.value) and asked == [("127.0.0.1", "127.0.0.1")]
    assert server.gets("l.safetensors") == []  # never connected: no request reached the server
    admit, asked = _only("127.0.0.1")
    with address_check(admit):
        snap = pull(url, root=root, progress=False)
    assert (snap / "l.safetensors").read_bytes() == b"x" * 1000 and asked == [("127.0.0.1", "127.0.0.1")]
    assert len(server.gets("l.safetensors")) == 1
    server.files["/m.safetensors"] = b"y" * 10
    outside = pull(server.url("m.safetensors"), root=root, progress=False)  # outside the context: no check
    assert (outside / "m.safetensors").read_bytes() == b"y" * 10 and len(asked) == 1


def test_address_check_applies_to_redirects(server, root):
    """An admitted host that redirects to a refused address gets no further: the redirect's
    connection is checked too (127.0.0.2: loopback, not on the test's list)."""
    from preheat.store import address_check

    port = server.server_address[1]
    server.redirects["/l.safetensors"] = f"http://127.0.0.2:{port}/elsewhere.safetensors"
    admit, asked = _only("127.0.0.1")
    with address_check(admit), pytest.raises(FetchError, match=r"127\.0\.0\.2 \(127\.0\.0\.2\) is refused"):
        pull(server.url("l.safetensors"), root=root, progress=False)
    assert asked == [("127.0.0.1", "127.0.0.1"), ("127.0.0.2", "127.0.0.2")]
    assert [h.status for h in server.hits] == [302]
