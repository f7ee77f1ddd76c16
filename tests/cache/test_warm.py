"""`preheat warm` and the server's background uploads, on the built-in model.

The fleet scenario end to end: a warm job (the command, in this process: it waits for its own
pushes) compiles the declared set and pushes it to a moto S3 store; a server on another fresh root
and a new compiler pulls every program (warm-up all ``aot``) and serves with no compile. Uploads from a server run in the
background: a store whose manifest writes are held by a gate shows serving is not held by them
and that ``Core.close`` waits for them. No assertion depends on timing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import preheat
from preheat.cache.compile import JaxCompiler
from preheat.cache.entries import publish_entry
from preheat.cache.remote import open_store
from preheat.cache.remote.background import BackgroundPushes
from preheat.warm import WarmSet
from preheat.cli import main
from preheat.server.core import Core, CoreConfig
from tests._support.gated import GatedStore
from tests._support.s3_server import s3_server

@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def _builtin(root: Path, remote) -> object:
    pipe = preheat.load(None, cache="off")
    pipe.compiler = JaxCompiler(root=root, remote=remote)
    return pipe


def _predict(core: Core, n: int = 2) -> dict:
    job, given = core.parse({"num_outputs": n, "seed": 3, "num_inference_steps": 2})
    pred, _ = core.submit(job, given)
    assert pred.done.wait(120)
    return core.snapshot(pred)


def test_warm_then_serve_from_the_store_compiles_nothing(s3, tmp_path, monkeypatch):
    url = f"s3://{s3.new_bucket()}/fleet"
    env = {**s3.env(), "PREHEAT_CACHE_URL": url, "PREHEAT_TRUST_REMOTE_CACHE": "1",
           "PREHEAT_HOME": str(tmp_path / "build-root")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    declaration = ["--max-batch-size", "2"]

    before = CliRunner().invoke(main, ["warm", *declaration, "--dry-run"], catch_exceptions=False)
    assert before.exit_code == 0, before.output
    rows = [line for line in before.output.splitlines() if " key " in line]
    # built-in model: its sampler x guidance off/on x buckets 1, 2
    assert len(rows) == 4 and all("local missing, remote missing" in r for r in rows), before.output
    assert {r.split(" batch ")[1].split()[0] for r in rows} == {"1", "2"}

    warm = CliRunner().invoke(main, ["warm", *declaration], catch_exceptions=False)  # waits for its pushes
    assert warm.exit_code == 0, warm.output
    assert "4 signature(s) ready" in warm.stdout

    after = CliRunner().invoke(main, ["warm", *declaration, "--dry-run"], catch_exceptions=False)
    rows_after = [line for line in after.output.splitlines() if " key " in line]
    assert [r.split("  key ")[0] for r in rows_after] == [r.split("  key ")[0] for r in rows]
    assert all("local cached, remote cached" in r for r in rows_after), after.output

    # a new pod: a fresh root, the same declaration, the store from the warm job
    pod_root = tmp_path / "pod-root"
    store = open_store(url, trust=True)
    config = CoreConfig.from_warm_set(WarmSet(max_batch_size=2), batch_wait_ms=0, max_steps=20)  # = the warm job's
    core = Core(config, pipe=_builtin(pod_root, store)).start()
    try:
        assert core.wait_setup(300) and core.status == "READY", core.setup.logs
        reg = core.metrics.registry
        assert reg.get_sample_value("preheat_warmup_programs_total", {"cache_layer": "aot"}) == 4
        for layer in ("none", "xla", "memory"):
            assert not reg.get_sample_value("preheat_warmup_programs_total", {"cache_layer": layer})
        snap = _predict(core)
        assert snap["status"] == "succeeded" and snap["metrics"]["compiled"] is False
        assert core.batcher.stats["traffic_compiles"] == 0
        assert not reg.get_sample_value("preheat_compiles_total", {"phase": "traffic"})
    finally:
        core.close()


def test_uploads_run_in_the_background_and_close_waits_for_them(tmp_path):
    root = tmp_path / "root"
    store = GatedStore(tmp_path / "store")
    # a local entry the store lacks (compiled while it was down): uploaded after warm-up too
    stale = "cd" * 16
    publish_entry(root / "compile" / "jax", stale, {"executable.bin": b"x" * 10}, {"schema": 1})
    config = CoreConfig(max_batch_size=1, batch_wait_ms=0, max_steps=20, guidance=("on",), push_grace_s=300)
    core = Core(config, pipe=_builtin(root, store)).start()
    closer = None
    try:
        assert core.wait_setup(300) and core.status == "READY", core.setup.logs
        assert store.entered.wait(300)  # an upload is stuck on the gate ...
        assert core.pending_pushes == 2  # ... the warm-up's entry and the stale one
        snap = _predict(core, n=1)  # ... and serving goes on
        assert snap["status"] == "succeeded"
        keys = [p.name for p in (root / "compile" / "jax").iterdir() if not p.name.startswith(".")]
        assert len(keys) == 2 and stale in keys
        assert not any((store.base / "compile" / "jax" / k / "manifest.json").exists() for k in keys)

        closer = threading.Thread(target=core.close)
        closer.start()
        assert core.closing_pushes.wait(120)
        assert closer.is_alive() and core.pending_pushes == 2  # close is waiting on the gated uploads
    finally:
        store.gate.set()
        if closer is not None:
            closer.join(300)
        else:
            core.close()
    assert not closer.is_alive()
    assert core.pending_pushes == 0
    assert all((store.base / "compile" / "jax" / k / "manifest.json").is_file() for k in keys)


def test_waiting_for_uploads_is_bounded(tmp_path):
    root = tmp_path / "root"
    publish_entry(root / "compile" / "jax", "ef" * 16, {"executable.bin": b"y"}, {"schema": 1})
    store = GatedStore(tmp_path / "store")
    pushes = BackgroundPushes(store)
    pushes.submit("jax", root / "compile" / "jax" / ("ef" * 16))
    assert store.entered.wait(60)
    assert pushes.wait(0.05) is False and pushes.pending == 1
    store.gate.set()
    assert pushes.wait(60) is True and pushes.results == [("ef" * 16, "pushed")]
