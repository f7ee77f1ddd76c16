"""`preheat serve`'s idle retune (``--retune-idle-s``; ``preheat.cache.retune.IdleRetuner``), on a
real server on 127.0.0.1 with a real HTTP client.

XLA:CPU does not autotune, and its entries say ``platform: cpu``, so two things are injected, as
tests/cache/test_retune.py does: the GPU's trigger (``autotunes_here`` -> True, and
``needs_retune`` that takes a CPU entry compiled without autotuning), and the two timings (the
``timer`` seam; each timed call still runs the executable on the worker). Everything else is
real: entries written by a warm-up, loaded by a fresh pipeline, compiled again on a thread of its
own, swapped in memory and replaced on disk. The compile is held on an Event the test controls,
so that "while it compiles" is a state, never a timing.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

import preheat
from preheat.cache import retune
from preheat.cache.entries import iter_entries, open_entry, rewrite_manifest
from preheat.cli import main
from preheat.errors import InvalidArgumentError
from preheat.server.config import parse_idle_s
from preheat.server.core import Core, CoreConfig
from preheat.server.images import decode_data_url
from tests._support.server_fixtures import metric, serving, wait_until
from tests._support.tiers import gpu_only

# Retune is a GPU's (XLA:CPU never autotunes; the trigger and timings are injected): make test-slow.
pytestmark = gpu_only

DEVICELESS_S, AUTOTUNED_S = 0.0125, 0.0100  # injected: the autotuned compile is 20% faster
BODY = {"input": {"seed": 5, "class_label": 3}}


def _needs_retune_any_platform(manifest: dict[str, Any]) -> bool:
    """``needs_retune`` without its GPU-only clause: a CPU entry is never autotuned either."""
    return manifest.get("autotuned") is False and "retune" not in manifest


@pytest.fixture(scope="module")
def warm_root(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root holding the entries a server's warm-up wrote (compiled here: not autotuned)."""
    root = tmp_path_factory.mktemp("retune-root")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREHEAT_HOME", str(root))
        core = Core(_config(model_dir, None), pipe=preheat.load(model_dir)).start()
        try:
            assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
            assert "cache: none" in core.setup.logs[-2]  # compiled and stored
        finally:
            core.close()
    return root


def _config(model_dir: Path, idle_s: float | None) -> CoreConfig:
    return CoreConfig(model=str(model_dir), max_batch_size=1, guidance=("on",), batch_wait_ms=0,
                      retune_idle_s=idle_s)


def _entries(root: Path) -> list[Path]:
    return list(iter_entries(root / "compile" / "jax"))


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest.json").read_text())


class Compiles:
    """Wraps the compiler's ``compile_autotuned``: counts calls, holds each on ``gate`` while it is
    clear, and remembers what it returned."""

    def __init__(self, real: Any, fail: bool = False) -> None:
        self.real, self.fail = real, fail
        self.gate = threading.Event()
        self.gate.set()
        self.entered, self.left = threading.Event(), threading.Event()
        self.calls = 0
        self.made: list[Any] = []

    def __call__(self, program: Any, args: Any) -> Any:
        self.calls += 1
        self.entered.set()
        assert self.gate.wait(120)
        try:
            if self.fail:
                raise RuntimeError("out of memory while autotuning\nsecond line")
            executable, files = self.real(program, args)
            self.made.append(executable)
            return executable, files
        finally:
            self.left.set()


class Timer:
    """The injected timings: each call really runs the executable (on the worker), and records
    how many batches had run by then."""

    def __init__(self, core: Core, compiles: Compiles, fail: bool = False) -> None:
        self.core, self.compiles, self.fail = core, compiles, fail
        self.batches_seen: list[int] = []

    def __call__(self, executable: Any, args: Any) -> float:
        self.batches_seen.append(self.core.batcher.stats["batches"])
        retune.timed_call(executable, args)
        if self.fail:
            raise RuntimeError("device lost while timing")
        return AUTOTUNED_S if any(executable is e for e in self.compiles.made) else DEVICELESS_S


class Served:
    """A server on a copy of the warm root, with retuning faked to be possible here."""

    def __init__(self, core: Core, pipe: Any, root: Path, compiles: Compiles, timer: Timer) -> None:
        self.core, self.pipe, self.root, self.compiles, self.timer = core, pipe, root, compiles, timer


@pytest.fixture
def serve(model_dir: Path, warm_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``serve(idle_s, autotuned=False, fail_compile=False, fail_timing=False, hold=False, paused=False)``:
    a started server (set up, READY; ``paused``: its core paused before it started) and an httpx
    client; the fixture closes them."""
    monkeypatch.setattr(retune, "autotunes_here", lambda: True)
    monkeypatch.setattr(retune, "needs_retune", _needs_retune_any_platform)
    opened: list[Any] = []

    def start(idle_s: float | None, autotuned: bool = False, fail_compile: bool = False, fail_timing: bool = False,
              hold: bool = False, paused: bool = False) -> tuple[Served, httpx.Client]:
        root = tmp_path / f"root-{len(opened)}"
        shutil.copytree(warm_root, root)
        if autotuned:
            for path in _entries(root):
                rewrite_manifest(path, {**_manifest(path), "autotuned": True})
        monkeypatch.setenv("PREHEAT_HOME", str(root))
        pipe = preheat.load(model_dir)
        compiles = Compiles(pipe.compiler.compile_autotuned, fail=fail_compile)
        if hold:
            compiles.gate.clear()
        pipe.compiler.compile_autotuned = compiles
        core = Core(_config(model_dir, idle_s), pipe=pipe)
        timer = Timer(core, compiles, fail=fail_timing)
        if core.retuner is not None:
            core.retuner.timer = timer
        if paused:
            core.pause()
        core.start()
        opened.append(core)
        assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
        assert "(cache: aot)" in core.setup.logs[1]  # served from the entry at once
        server = serving(core)
        srv = server.__enter__()
        opened.append(server)
        client = httpx.Client(base_url=srv.url, timeout=120)
        opened.append(client)
        return Served(core, pipe, root, compiles, timer), client

    yield start
    for thing in reversed(opened):
        if isinstance(thing, Core):
            thing.close()
        elif isinstance(thing, httpx.Client):
            thing.close()
        else:
            thing.__exit__(None, None, None)


def _image(client: httpx.Client) -> np.ndarray:
    response = client.post("/predictions", json=BODY)
    assert response.status_code == 200, response.text
    snap = response.json()
    assert snap["status"] == "succeeded", snap
    return decode_data_url(snap["output"][0])


def test_an_idle_server_retunes_its_not_autotuned_entry_and_serves_the_new_executable(serve) -> None:
    s, client = serve(0.05, hold=True)
    (entry,) = _entries(s.root)
    before_manifest = _manifest(entry)
    (sig,) = s.pipe.executables.signatures()
    old = s.pipe.executables.get(sig)
    before = _image(client)
    assert s.core.retuner.waiting == 1
    s.compiles.gate.set()
    wait_until(lambda: s.core.retuner.stats["replaced"] == 1, 120, "the retune")

    after_manifest = _manifest(entry)
    assert after_manifest["retune"]["replaced"] is True and after_manifest["autotuned"] is True
    assert (after_manifest["retune"]["deviceless_s"], after_manifest["retune"]["autotuned_s"]) == (DEVICELESS_S,
                                                                                                 AUTOTUNED_S)
    assert after_manifest["fields"] == before_manifest["fields"]
    assert open_entry(entry.parent, entry.name, before_manifest["fields"]) is not None  # verified afresh
    (new,) = s.compiles.made
    assert s.pipe.executables.get(sig) is new and new is not old  # the server serves the replaced one
    # one untimed call and TIMED_CALLS timed ones of each, all after the warm-up's batch-free idle
    assert len(s.timer.batches_seen) == 2 * (1 + retune.TIMED_CALLS)
    after = _image(client)
    assert np.array_equal(after, before)  # the same program (XLA:CPU: the same code)
    assert s.core.batcher.stats["traffic_compiles"] == 0 and s.pipe.last.cache_layer == "memory"
    text = client.get("/metrics").text
    assert metric(text, "preheat_retunes_total", '{outcome="replaced"}') == 1
    assert metric(text, "preheat_retunes_waiting") == 0
    assert client.get("/health-check").json()["status"] == "READY"


def test_requests_are_served_while_the_retune_compiles_and_its_timed_calls_wait_for_an_empty_queue(serve) -> None:
    s, client = serve(0.05, hold=True)
    core = s.core
    assert s.compiles.entered.wait(60)  # idle: the autotuned compile began, and is held there
    before = _image(client)  # served at once, from the old executable, while the compile is held
    assert not s.compiles.left.is_set() and s.compiles.calls == 1
    assert s.timer.batches_seen == []

    core.pause()  # a request queued (not yet running) when the compile finishes
    pending: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: pending.append(httpx.post(f"{client.base_url}/predictions", json=BODY,
                                                                       timeout=120)))
    thread.start()
    wait_until(lambda: core.queue_depth == 1, 60, "the queued request")
    s.compiles.gate.set()
    wait_until(lambda: core.retuner.compiled, 120, "the compile")
    time.sleep(0.3)  # room for a worker that took a timed call with a request waiting (none may)
    assert s.timer.batches_seen == []
    batches = core.batcher.stats["batches"]
    core.resume()
    thread.join(120)
    assert pending and pending[0].status_code == 200
    wait_until(lambda: core.retuner.stats["replaced"] == 1, 120, "the retune")
    assert s.timer.batches_seen and min(s.timer.batches_seen) == batches + 1  # every call after the request
    assert np.array_equal(decode_data_url(pending[0].json()["output"][0]), before)


def test_no_retune_when_off_nor_of_an_autotuned_entry(serve) -> None:
    s, client = serve(None)  # --retune-idle-s off
    assert s.core.retuner is None and not s.pipe.compiler.retune_later and s.pipe.compiler.retune_candidates == []
    manifests = [_manifest(p) for p in _entries(s.root)]
    _image(client)
    time.sleep(0.3)  # idle well past what the next server waits
    assert s.compiles.calls == 0 and [_manifest(p) for p in _entries(s.root)] == manifests
    assert metric(client.get("/metrics").text, "preheat_retunes_total", '{outcome="replaced"}') == 0

    s, client = serve(0.05, autotuned=True)  # an entry already autotuned
    assert s.pipe.compiler.retune_candidates == [] and s.core.retuner.waiting == 0
    manifests = [_manifest(p) for p in _entries(s.root)]
    _image(client)
    time.sleep(0.3)
    assert s.compiles.calls == 0 and [_manifest(p) for p in _entries(s.root)] == manifests
    assert parse_idle_s("off") is None and parse_idle_s("0") is None and parse_idle_s("2.5") == 2.5
    with pytest.raises(InvalidArgumentError, match="--retune-idle-s 'soon' must be seconds"):
        parse_idle_s("soon")


@pytest.mark.parametrize("where", ["compile", "timing"])
def test_a_failed_retune_leaves_the_old_executable_serving_and_the_server_healthy(serve, model_dir: Path,
                                                                                  where: str) -> None:
    s, client = serve(0.05, hold=True, fail_compile=where == "compile", fail_timing=where == "timing")
    (entry,) = _entries(s.root)
    before_manifest = _manifest(entry)
    (sig,) = s.pipe.executables.signatures()
    old = s.pipe.executables.get(sig)
    before = _image(client)
    s.compiles.gate.set()
    wait_until(lambda: s.core.retuner.stats["failed"] == 1, 120, "the failed retune")

    assert s.pipe.executables.get(sig) is old
    after_manifest = _manifest(entry)
    assert after_manifest["retune"]["failed"].startswith("RuntimeError: ")
    assert {k: v for k, v in after_manifest.items() if k != "retune"} == before_manifest  # the executable stays
    assert open_entry(entry.parent, entry.name, before_manifest["fields"]) is not None
    assert np.array_equal(_image(client), before)
    assert client.get("/health-check").json()["status"] == "READY"
    assert metric(client.get("/metrics").text, "preheat_retunes_total", '{outcome="failed"}') == 1
    assert s.core.retuner.waiting == 0  # not retried in a loop
    # the cache's own commands say so (the manifest written by ``retune.record_failure``, as `preheat warm` does)
    said = f"retune failed: {after_manifest['retune']['failed']}"
    listed = CliRunner().invoke(main, ["cache", "ls"], env={"COLUMNS": "400"})
    assert listed.exit_code == 0 and said in " ".join(listed.output.split()), listed.output
    explained = CliRunner().invoke(main, ["cache", "explain", str(model_dir), "--class", "3", "--n", "1"])
    assert explained.exit_code == 0, explained.output
    # the server's call differs from sample's defaults (batch, progress): its entry is the nearest, labelled
    assert f"nearest entry {entry.name[:12]} (target local (not autotuned; {said}))" in explained.output


def test_a_paused_server_runs_no_retune_job(serve) -> None:
    """Paused means paused: with an empty queue, a paused core neither starts the autotuned
    compile nor takes a timed call, however long it is idle; resumed, it retunes."""
    s, client = serve(0.05, paused=True)
    core = s.core
    time.sleep(0.5)  # ten times the idle time: a running worker would have started the compile
    assert s.compiles.calls == 0 and not core.retuner.busy and core.queue_depth == 0
    assert metric(client.get("/metrics").text, "preheat_retunes_waiting") == 1

    s.compiles.gate.clear()  # resumed: the compile starts (held), and the core is paused again
    core.resume()
    assert s.compiles.entered.wait(60)
    core.pause()
    s.compiles.gate.set()
    wait_until(lambda: core.retuner.compiled, 120, "the compile")  # it finishes on its own thread ...
    time.sleep(0.5)
    assert s.timer.batches_seen == [] and core.queue_depth == 0  # ... and no timed call runs while paused
    assert core.retuner.stats == {"replaced": 0, "kept": 0, "failed": 0, "canceled": 0}

    core.resume()
    wait_until(lambda: core.retuner.stats["replaced"] == 1, 120, "the retune")
    assert len(s.timer.batches_seen) == 2 * (1 + retune.TIMED_CALLS)
    _image(client)


def test_shutting_down_cancels_a_pending_retune_and_writes_nothing(serve) -> None:
    s, client = serve(0.05, hold=True)
    (entry,) = _entries(s.root)
    files = {p.name: p.read_bytes() for p in entry.iterdir()}
    assert s.compiles.entered.wait(60)
    s.core.close()  # the compile is still held
    assert s.core.retuner.stats["canceled"] == 1
    s.compiles.gate.set()
    assert s.compiles.left.wait(120)  # it finishes on its thread ...
    thread = threading.enumerate()
    for t in thread:
        if t.name == "preheat-retune-compile":
            t.join(60)
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == files  # ... and is thrown away
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]
    assert s.timer.batches_seen == []


def test_cache_explain_as_server_reports_the_served_entry_as_a_hit(warm_root: Path, model_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's call differs from `preheat sample`'s (its batch bucket, its step reports): `cache
    explain` calls the entry a server's warm-up wrote the nearest, `cache explain --as-server` with
    the server's declaration calls it a hit, and a call the server would make another way is a miss
    naming what differs."""
    monkeypatch.setenv("PREHEAT_HOME", str(warm_root))
    (entry,) = _entries(warm_root)

    def explain(*args: str, env: dict[str, str] | None = None, model: list[str] = [str(model_dir)]) -> str:
        result = CliRunner().invoke(main, ["cache", "explain", *model, "--class", "3", *args], env=env)
        assert result.exit_code == 0, result.output
        return result.output

    as_sample = explain("--n", "1")
    assert "miss: key" in as_sample and f"nearest entry {entry.name[:12]}" in as_sample, as_sample
    served = explain("--n", "1", "--as-server", "--max-batch-size", "1")
    assert "1 image(s) as batch 1, step reports on" in served and f"hit: entry {entry.name[:12]}" in served, served
    quiet = explain("--n", "1", "--as-server", "--max-batch-size", "1", "--no-progress")  # `serve --no-progress`
    assert "step reports off" in quiet and f"nearest entry {entry.name[:12]}" in quiet, quiet
    padded = explain("--n", "3", "--as-server", "--max-batch-size", "4")  # buckets 1, 2, 4: three images run as 4
    assert "3 image(s) as batch 4" in padded and "signature.batch" in padded, padded
    assert f"hit: entry {entry.name[:12]}" in explain("--n", "1", "--as-server")  # serve's 8: batch 1 is one of its buckets
    for args, needle in ((["--n", "2", "--as-server", "--max-batch-size", "1"], "exceed the largest batch bucket 1"),
                         (["--n", "1", "--max-batch-size", "1"], "pass --as-server")):
        bad = CliRunner().invoke(main, ["cache", "explain", str(model_dir), *args])
        assert bad.exit_code == 2 and needle in bad.output and len(bad.output.strip().splitlines()) == 1, bad.output

    # In a server's environment, --as-server reads its declaration as `preheat serve` does: the model,
    # its buckets, its step reports; a flag still wins over the variable.
    pod = {"PREHEAT_MODEL": str(model_dir), "PREHEAT_MAX_BATCH_SIZE": "4", "PREHEAT_PROGRESS": "off"}
    from_env = explain("--n", "3", "--as-server", env=pod, model=[])
    assert "3 image(s) as batch 4, step reports off" in from_env, from_env
    too_many = CliRunner().invoke(main, ["cache", "explain", "--n", "3", "--as-server"],
                                  env={**pod, "PREHEAT_MAX_BATCH_SIZE": "2"})
    assert too_many.exit_code == 2 and "exceed the largest batch bucket 2" in too_many.output, too_many.output
    flags_win = explain("--n", "1", "--as-server", "--max-batch-size", "1", "--progress", env=pod, model=[])
    assert "batch 1, step reports on" in flags_win and f"hit: entry {entry.name[:12]}" in flags_win, flags_win
    # ... and only with --as-server: as sample, a server's variables (even a malformed one) are not read
    as_sample_in_pod = explain("--n", "1", env={**pod, "PREHEAT_PROGRESS": "sometimes"})
    assert "as a server" not in as_sample_in_pod and "nearest entry" in as_sample_in_pod, as_sample_in_pod
    bad = CliRunner().invoke(main, ["cache", "explain", str(model_dir), "--as-server"],
                             env={"PREHEAT_MAX_BATCH_SIZE": "many"})
    assert bad.exit_code == 2 and "PREHEAT_MAX_BATCH_SIZE" in bad.output and len(bad.output.strip().splitlines()) == 1, (
        bad.output)
