"""The fleet's shared store as a weights mirror: one pod downloads from the internet, the others
pull the same (sha256-pinned) checkpoint from the shared store."""

from __future__ import annotations

import hashlib

from preheat.store import pull
from tests._support.store_fixtures import files_of, tar_bytes


def test_second_pod_pulls_a_pinned_checkpoint_from_the_fleet_mirror(server, tmp_path, model, monkeypatch):
    monkeypatch.setenv("PREHEAT_CACHE_URL", str(tmp_path / "fleet"))  # a shared folder (network volume)
    data = tar_bytes(model)
    server.files["/m.tar.gz"] = data
    url = server.url("m.tar.gz") + "#sha256=" + hashlib.sha256(data).hexdigest()

    first = pull(url, root=tmp_path / "pod-a", progress=False)
    assert len(server.gets("/m.tar.gz")) == 1
    server.stop()  # the origin is gone: the second pod can only use the mirror
    second = pull(url, root=tmp_path / "pod-b", progress=False)
    assert files_of(second) == files_of(first) == files_of(model)


def test_unpinned_url_does_not_use_the_mirror(server, tmp_path, model, monkeypatch):
    monkeypatch.setenv("PREHEAT_CACHE_URL", str(tmp_path / "fleet"))
    server.files["/m.tar.gz"] = tar_bytes(model)
    pull(server.url("m.tar.gz"), root=tmp_path / "pod-a", progress=False)
    pull(server.url("m.tar.gz"), root=tmp_path / "pod-b", progress=False)
    assert len(server.gets("/m.tar.gz")) == 2
