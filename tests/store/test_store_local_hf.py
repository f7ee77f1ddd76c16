"""Local folders and tarballs, hf:// parsing and offline behaviour, and safe source ids."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from preheat.errors import FetchError, InvalidArgumentError, ModelNotFoundError
from preheat.store import is_remote, parse_source, pull, resolve, source_id, verify_store
from preheat.store._layout import Store
from tests._support.store_fixtures import files_of, tar_bytes

SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# ---------------------------------------------------------------------------------------------
# local sources


def test_local_folder_is_ingested_and_resolves_after_it_is_gone(root, model):
    (model / ".cache").mkdir()
    (model / ".cache" / "junk.lock").write_text("x")
    want = {k: v for k, v in files_of(model).items() if not k.startswith(".")}
    snap = pull(model, root=root, progress=False)
    assert files_of(snap) == want  # hidden entries skipped
    assert snap.parent == root / "models" / "snapshots"
    ref = json.loads((root / "models" / "refs" / source_id(str(model))).read_text())
    assert ref["kind"] == "folder" and ref["source"] == str(model)

    assert resolve(str(model), root=root) == model  # an existing folder: as-is, no copy
    moved = model.with_name("moved")
    model.rename(moved)
    assert resolve(str(model), root=root) == snap  # only in the store now
    assert pull(str(model), root=root) == snap
    with pytest.raises(ModelNotFoundError) as err:
        resolve(str(model.with_name("never-pulled")), root=root)
    assert "does not exist" in str(err.value) and "\n" not in str(err.value)


def test_local_folder_pull_rereads_changes(root, model):
    first = pull(model, root=root)
    (model / "unet" / "config.json").write_text('{"_class_name": "UNet2DModel", "sample_size": 16}')
    second = pull(model, root=root)
    assert second != first and (second / "unet" / "config.json").read_text().endswith("16}")
    assert resolve(model.as_posix() + "/../" + model.name, root=root).resolve() == model.resolve()
    ref = json.loads((root / "models" / "refs" / source_id(str(model))).read_text())
    assert ref["snapshot"] == second.name
    # unchanged files were not stored twice
    assert len(os.listdir(root / "models" / "blobs")) == len(files_of(model)) + 1
    assert verify_store(root) == []


def test_local_tarball_and_file_url(root, model, tmp_path):
    tarball = tmp_path / "m.tar.gz"
    tarball.write_bytes(tar_bytes(model))
    snap = resolve(tarball, root=root)  # a local tarball is ingested on first use
    assert files_of(snap) == files_of(model)
    tarball.unlink()
    assert resolve(tarball, root=root) == snap
    assert resolve(tarball.as_uri(), root=root) == snap  # file:// is the same source
    assert pull(model.as_uri(), root=root) == pull(model, root=root)


# ---------------------------------------------------------------------------------------------
# source strings


@pytest.mark.parametrize("text, repo, rev", [
    ("hf://google/ddpm-cifar10-32", "google/ddpm-cifar10-32", None),
    ("hf://google/ddpm-cifar10-32@main", "google/ddpm-cifar10-32", "main"),
    ("hf://org/repo@refs/pr/3", "org/repo", "refs/pr/3"),
    ("hf://org/repo@0123456789abcdef0123456789abcdef01234567", "org/repo", "0123456789abcdef0123456789abcdef01234567"),
    ("hf://gpt2", "gpt2", None),
    ("HF://org/repo/", "org/repo", None),
])
def test_hf_parsing(text, repo, rev):
    src = parse_source(text)
    assert (src.kind, src.repo_id, src.revision) == ("hf", repo, rev)
    assert src.text == f"hf://{repo}" + (f"@{rev}" if rev else "")
    assert is_remote(text)


def test_hf_revision_argument():
    assert parse_source("hf://org/repo", revision="v1").revision == "v1"
    assert parse_source("hf://org/repo@v1", revision="v1").text == "hf://org/repo@v1"
    with pytest.raises(InvalidArgumentError, match="conflicting"):
        parse_source("hf://org/repo@v1", revision="v2")
    with pytest.raises(InvalidArgumentError, match="only to hf://"):
        parse_source("https://x/y.tar", revision="v2")


@pytest.mark.parametrize("text", [
    "hf://", "hf://org/../etc", "hf://../x", "hf://org/repo/sub", "hf://org/repo@", "hf://org/repo@../../x",
    "hf://org/re po", "hf://-org/repo", "hf://org/repo@-rf", "s3://bucket/key", "https:///nohost.tar", "",
])
def test_bad_sources_are_one_line_invalid_argument(text):
    with pytest.raises(InvalidArgumentError) as err:
        parse_source(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", [
    "../../etc/passwd", "/", ".", "..", "hf://org/repo@refs/pr/1", "https://h/../../a/b.tar.gz?x=/../y",
    "https://h/" + "a/" * 300 + "x.tar", "file:///..", "~/models/x", "weird \x00\n name",
])
def test_source_ids_are_safe_file_names(text, root):
    try:
        src = parse_source(text)
    except InvalidArgumentError:
        return
    sid = src.id
    assert SAFE_ID.match(sid) and sid not in (".", "..") and len(sid) < 120
    assert Store(root).ref_path(sid).parent == root / "models" / "refs"
    assert source_id(src.text) == sid


def test_is_remote():
    assert is_remote("https://x/y.tar.gz") and is_remote("HTTP://x") and is_remote("hf://a/b")
    assert not is_remote("/models/x") and not is_remote("file:///x") and not is_remote(Path("hf://a"))


# ---------------------------------------------------------------------------------------------
# hf:// (the hub itself cannot be reached from the tests: only offline behaviour is tested)


def _fake_hf_cache(hf_dir: Path, repo: str, commit: str, files: dict[str, bytes]) -> None:
    """What huggingface_hub leaves after a download: blobs, refs/main, snapshots of symlinks."""
    repo_dir = hf_dir / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    (repo_dir / "blobs").mkdir()
    for rel, data in files.items():
        import hashlib

        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = repo_dir / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


@pytest.fixture
def hf_offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_hf_offline_not_cached_is_one_line_fetch_error(root, hf_offline):
    with pytest.raises(FetchError) as err:
        pull("hf://org/not-cached", root=root, progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "HF_HUB_OFFLINE" in msg and "hf://org/not-cached" in msg
    with pytest.raises(FetchError) as err:
        resolve("hf://org/not-cached", root=root)  # HF_HUB_OFFLINE makes resolve offline too
    assert "not in the store" in str(err.value) and "HF_HUB_OFFLINE" in str(err.value)
    assert os.listdir(root / "models" / "refs") == []


def test_hf_pull_from_cache_then_resolve_without_network(root, model, hf_offline, monkeypatch):
    commit = "c0ffee" + "0" * 34
    files = dict(files_of(model))
    files["unet/diffusion_pytorch_model.bin"] = b"torch pickle, never fetched nor stored"
    _fake_hf_cache(root / "models" / "hf", "org/tiny", commit, files)

    snap = pull("hf://org/tiny", root=root, progress=False)  # the real snapshot_download, offline
    assert files_of(snap) == files_of(model)  # *.bin filtered out
    ref = json.loads((root / "models" / "refs" / source_id("hf://org/tiny")).read_text())
    assert ref["kind"] == "hf" and ref["repo_id"] == "org/tiny" and ref["commit"] == commit
    cfg = root / "models" / "hf" / "models--org--tiny" / "snapshots" / commit / "unet" / "config.json"
    assert os.stat(cfg).st_ino == os.stat(snap / "unet" / "config.json").st_ino  # hardlinked, not copied

    # from now on: no huggingface_hub call and no socket at all
    import huggingface_hub

    def no_network(*a, **k):
        raise AssertionError("network used")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve("hf://org/tiny", root=root) == snap
    assert resolve("hf://org/tiny", root=root, offline=False, verify=True) == snap
    assert pull("hf://org/tiny", root=root, progress=False) == snap
    with pytest.raises(FetchError, match="network used"):  # another revision is another source: it is fetched
        resolve("hf://org/tiny@v2", root=root, progress=False)


def _run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    code = "import sys; from preheat.cli.pull import pull_command; pull_command(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_cli_hf_offline_and_unreachable_hub(root):
    off = _run_cli(["hf://org/repo", "-q"], {"PREHEAT_HOME": str(root), "HF_HUB_OFFLINE": "1"})
    assert off.returncode == 1 and off.stdout == ""
    assert off.stderr.startswith("error: ") and off.stderr.count("\n") == 1 and "HF_HUB_OFFLINE" in off.stderr

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = _run_cli(["hf://org/repo@main", "-q"], {"PREHEAT_HOME": str(root), "HF_HUB_OFFLINE": "0",
                                                   "HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert down.returncode == 1 and down.stderr.count("\n") == 1
    assert "unreachable" in down.stderr and "hf://org/repo@main" in down.stderr
