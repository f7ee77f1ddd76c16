"""Where the preheat and Hugging Face caches live, free space, writability, cache health."""

from __future__ import annotations

from collections import namedtuple

from preheat.doctor.checks import cache_health, storage
from tests._support.doctor_fixtures import check

Usage = namedtuple("Usage", "total used free")


def test_cache_root_on_container_disk_while_workspace_exists_warns(machine, monkeypatch):
    machine.workspace.mkdir()
    container = machine.root / "container" / "preheat"
    monkeypatch.setenv("PREHEAT_HOME", str(container))
    code, rep = machine.run()
    c = check(rep, "storage_cache")
    assert c["status"] == "warn"
    assert c["finding"].startswith(f"{container} (chosen by: $PREHEAT_HOME is set; not created yet); on the container disk, which is lost when the pod restarts ({machine.workspace} is a persistent volume)")
    assert c["fix"] == f"export PREHEAT_HOME={machine.workspace}/.cache/preheat"
    assert c["details"]["persistent"] is False
    assert code == 0


def test_cache_root_under_workspace_ok(machine, monkeypatch):
    machine.workspace.mkdir()
    monkeypatch.setenv("HF_HOME", str(machine.workspace / ".cache" / "huggingface"))
    _, rep = machine.run()
    c = check(rep, "storage_cache")
    assert c["status"] == "ok", c
    assert c["finding"].startswith(f"{machine.workspace}/.cache/preheat (chosen by: {machine.workspace} is a writable Runpod pod volume; not created yet); on the persistent volume {machine.workspace}")
    assert c["fix"] is None and c["details"]["persistent"] is True
    hf = check(rep, "storage_hf")
    assert hf["status"] == "ok", hf
    assert f"on the persistent volume {machine.workspace}" in hf["finding"]


def test_hf_cache_in_home_while_workspace_exists_warns(machine):
    machine.workspace.mkdir()
    _, rep = machine.run()
    hf = check(rep, "storage_hf")
    assert hf["status"] == "warn"
    assert hf["finding"].startswith(f"{machine.home}/.cache/huggingface/hub (chosen by: default (~/.cache/huggingface/hub); not created yet); on the container disk")
    assert hf["fix"] == f"export HF_HOME={machine.workspace}/.cache/huggingface"


def test_hf_hub_cache_variable_is_the_one_to_fix(machine, monkeypatch):
    machine.runpod_volume.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", "/tmp/hf-hub")
    _, rep = machine.run()
    hf = check(rep, "storage_hf")
    assert hf["status"] == "warn"
    assert hf["fix"] == f"export HF_HUB_CACHE={machine.runpod_volume}/.cache/huggingface/hub"
    # the preheat cache picked the network volume by itself
    c = check(rep, "storage_cache")
    assert c["status"] == "ok" and f"on the persistent volume {machine.runpod_volume}" in c["finding"]


def test_runpod_volume_fix_uses_resolve_root_layout(machine, monkeypatch):
    machine.runpod_volume.mkdir()
    monkeypatch.setenv("PREHEAT_HOME", str(machine.root / "elsewhere"))
    _, rep = machine.run()
    assert check(rep, "storage_cache")["fix"] == f"export PREHEAT_HOME={machine.runpod_volume}/preheat"


def test_off_runpod_without_volumes_is_ok(machine):
    _, rep = machine.run()
    c = check(rep, "storage_cache")
    assert c["status"] == "ok"
    assert f"not on a Runpod volume (no {machine.runpod_volume} or {machine.workspace} on this machine)" in c["finding"]


def test_runpod_pod_without_volume_warns(machine, monkeypatch):
    monkeypatch.setenv("RUNPOD_POD_ID", "abc123xyz")
    _, rep = machine.run()
    c = check(rep, "storage_cache")
    assert c["status"] == "warn"
    assert f"this pod has no volume ({machine.runpod_volume} or {machine.workspace} missing): everything is lost when it stops" in c["finding"]
    assert c["fix"].startswith("attach a network volume or volume disk")


def test_low_free_space_warns(machine, monkeypatch):
    machine.workspace.mkdir()
    monkeypatch.setattr(storage, "_disk_usage", lambda path: Usage(100 * 2**30, 98 * 2**30, 2 * 2**30))
    _, rep = machine.run()
    c = check(rep, "storage_cache")
    assert c["status"] == "warn"
    assert f"only 2.0 GiB free on {machine.workspace} (< 5 GiB)" in c["finding"]
    assert c["fix"] == f"free space on {machine.workspace} or point PREHEAT_HOME at a larger volume"


def test_unwritable_cache_root_fails_and_unwritable_hf_cache_warns(machine, monkeypatch):
    monkeypatch.setattr(storage, "_writable", lambda path: False)
    code, rep = machine.run()
    c, hf = check(rep, "storage_cache"), check(rep, "storage_hf")
    assert c["status"] == "fail" and hf["status"] == "warn"
    assert f"{machine.home} is not writable by this user" in c["finding"]
    assert c["fix"] == f"chmod u+w {machine.home} (or run as its owner), or export PREHEAT_HOME=<a writable folder>"
    assert code == 1


def test_cache_health_counts_and_verifies_entries(machine, tmp_path):
    from preheat.cache.entries import publish_entry

    root = tmp_path / "root"
    kind = root / "compile" / "jax"
    publish_entry(kind, "a" * 32, {"executable.bin": b"x" * 1000}, {"f": 1})
    publish_entry(kind, "b" * 32, {"executable.bin": b"y" * 1000}, {"f": 2})
    ok = cache_health._check_cache_health(root)
    assert ok.status == "ok" and ok.finding.startswith("2 compiled entries")
    (kind / ("b" * 32) / "executable.bin").write_bytes(b"z" * 1000)  # same size, other bytes
    bad = cache_health._check_cache_health(root)
    assert bad.status == "warn" and "1 compile entries fail verification" in bad.finding
    assert bad.fix == "preheat cache verify --quarantine && preheat cache prune"


def test_cache_health_on_a_missing_root_is_ok(machine, tmp_path):
    result = cache_health._check_cache_health(tmp_path / "never-created")
    assert result.status == "ok" and "nothing cached" in result.finding
