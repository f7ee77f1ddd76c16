"""Corruption is detected; unsafe tarballs are refused before anything is written."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile

import pytest

from preheat.errors import FetchError
from preheat.store import pull, resolve, source_id, verify_store
from tests._support.store_fixtures import files_of, tar_bytes


def _flip_byte(path, offset=-10):
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    with open(path, "r+b") as fh:
        fh.seek(offset, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_corrupted_blob_is_detected_and_repaired(server, root, model):
    server.files["/m.tar.gz"] = tar_bytes(model)
    url = server.url("m.tar.gz")
    snap = pull(url, root=root, progress=False)
    assert verify_store(root) == []
    weights = (model / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    blob = root / "models" / "blobs" / hashlib.sha256(weights).hexdigest()
    _flip_byte(blob)  # same size: only a hash can see it

    problems = verify_store(root)
    assert any(p.path == blob and "corrupt blob" in p.message for p in problems)
    assert any(p.path == snap / "unet/diffusion_pytorch_model.safetensors" for p in problems)
    assert all("\n" not in str(p) for p in problems)

    assert resolve(url, root=root, offline=True) == snap  # cheap check: sizes only
    with pytest.raises(FetchError) as err:
        resolve(url, root=root, offline=True, verify=True)
    assert "damaged" in str(err.value) and "sha256" in str(err.value) and "\n" not in str(err.value)

    # online, a verifying resolve pulls again and replaces the bad blob
    assert resolve(url, root=root, verify=True, progress=False) == snap
    assert len(server.gets("m.tar.gz")) == 2
    assert verify_store(root) == []
    assert files_of(snap) == files_of(model)


def test_truncated_snapshot_file_is_not_complete(server, root, model):
    server.files["/t.tar.gz"] = tar_bytes(model)
    url = server.url("t.tar.gz")
    snap = pull(url, root=root, progress=False)
    f = snap / "unet" / "config.json"
    os.chmod(f, 0o644)
    with open(f, "r+b") as fh:
        fh.truncate(3)
    with pytest.raises(FetchError) as err:
        resolve(url, root=root, offline=True)
    assert "unet/config.json has 3 bytes" in str(err.value)
    assert any("config.json" in str(p) for p in verify_store(root))
    # a plain pull sees the damage too, and repairs it
    assert pull(url, root=root, progress=False) == snap
    assert verify_store(root) == [] and files_of(snap) == files_of(model)


def test_unreadable_ref_is_reported_and_ignored(root, model):
    snap = pull(model, root=root)
    ref = root / "models" / "refs" / source_id(str(model))
    doc = json.loads(ref.read_text())
    doc["files"][0]["path"] = "../../escape"
    ref.write_text(json.dumps(doc))
    assert any("unreadable ref" in p.message and p.path == ref for p in verify_store(root))
    # an existing local folder still resolves to itself; the bad ref is never followed
    assert resolve(model, root=root) == model
    assert snap.is_dir()


def _tar(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name, data=b"x"):
    return tarfile.TarInfo(name), data


def _link(name, target, kind=tarfile.SYMTYPE):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def _special(name):
    info = tarfile.TarInfo(name)
    info.type = tarfile.FIFOTYPE
    return info, None


@pytest.mark.parametrize("members, why", [
    ([_file("model/config.json"), _file("../evil.txt")], "path traversal"),
    ([_file("model/config.json"), _file("model/../../evil.txt")], "path traversal"),
    ([_file("/tmp/evil.txt")], "path traversal"),
    ([_file("model/config.json"), _link("model/evil", "../../outside.txt")], "points outside the archive"),
    ([_file("model/config.json"), _link("model/evil", "/etc/passwd")], "absolute path"),
    ([_file("model/config.json"), _link("model/evil", "../x", tarfile.LNKTYPE)], "points outside the archive"),
    ([_file("model/config.json"), _special("model/fifo")], "special file"),
], ids=["dotdot", "nested-dotdot", "absolute", "symlink-out", "symlink-abs", "hardlink-out", "fifo"])
def test_unsafe_tarball_is_refused(server, root, tmp_path, members, why):
    server.files["/evil.tar.gz"] = _tar(members)
    with pytest.raises(FetchError) as err:
        pull(server.url("evil.tar.gz"), root=root, progress=False)
    msg = str(err.value)
    assert msg.startswith("refusing to extract") and why in msg and "\n" not in msg
    models = root / "models"
    assert os.listdir(models / "refs") == [] and os.listdir(models / "snapshots") == []
    assert os.listdir(models / "blobs") == []  # refused before any member was written
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "outside.txt").exists()


def test_links_inside_the_archive_become_files(server, root):
    server.files["/ok.tar"] = _tar([
        _file("m/unet/config.json", b'{"a": 1}'),
        _link("m/config_link.json", "unet/config.json"),
        _link("m/hard.json", "m/unet/config.json", tarfile.LNKTYPE),
    ])
    snap = pull(server.url("ok.tar"), root=root, progress=False)
    assert files_of(snap) == {"config_link.json": b'{"a": 1}', "hard.json": b'{"a": 1}', "unet/config.json": b'{"a": 1}'}
    assert not any(p.is_symlink() for p in snap.rglob("*"))


@pytest.mark.parametrize("kind", ["junk", "truncated"])
def test_bad_tarball_is_one_line_error(server, root, model, kind):
    good = tar_bytes(model)
    server.files["/bad.tar.gz"] = b"this is not a tar archive" * 100 if kind == "junk" else good[: len(good) // 2]
    with pytest.raises(FetchError) as err:
        pull(server.url("bad.tar.gz"), root=root, progress=False)
    msg = str(err.value)
    assert "\n" not in msg
    assert ("not a readable tar archive" if kind == "junk" else "damaged tar archive") in msg
    assert os.listdir(root / "models" / "refs") == []


def test_hidden_tar_entries_are_skipped(server, root):
    server.files["/mac.tar.gz"] = _tar([_file("m/config.json", b"{}"), _file("m/._config.json", b"\0\5\0"),
                                        _file("m/.git/HEAD", b"ref")])
    snap = pull(server.url("mac.tar.gz"), root=root, progress=False)
    assert files_of(snap) == {"config.json": b"{}"}
