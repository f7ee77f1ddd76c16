"""Start-up overlap (issue 17): the executable loads on a background thread while the weights are
read; the phases say so, and a failing background load falls back to a compile (same image).

A slow store and a slow weight read are injected as a rendezvous, not as sleeps: the first tensor
read waits until the store's fetch has begun, and the fetch until that read has begun, each up to
``RENDEZVOUS_S``. Overlapping phases meet at once on any machine, however loaded; sequential ones
cannot meet, and the test fails on that, never on how long anything took."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import preheat
from preheat.cache.remote.compile_entries import CompileEntries
from preheat.models import safetensors_files, weights
from preheat.models.safetensors_files import TensorInfo
from tests._support.reference import save_tiny_pipeline

CALL = dict(n=2, steps=3, sampler="euler", seed=7, class_labels=[1, 2])
RENDEZVOUS_S = 120.0  # how long either slow phase waits for the other to begin (met at once when they overlap)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("m") / "pipe")


@pytest.fixture(scope="module")
def published(model_dir, tmp_path_factory):
    """(reference pixels, a local root holding the entry, a shared-folder store holding it too)."""
    base = tmp_path_factory.mktemp("published")
    mp = pytest.MonkeyPatch()
    mp.setenv("PREHEAT_HOME", str(base / "home"))
    mp.setenv("PREHEAT_CACHE_URL", str(base / "store"))
    mp.setenv("PREHEAT_TRUST_REMOTE_CACHE", "1")
    try:
        pipe = preheat.load(model_dir)
        pixels = pipe.generate(**CALL)
        assert pipe.compiler.events[-1]["remote_push"] == "pushed", pipe.compiler.events
    finally:
        mp.undo()
    return pixels, base / "home", base / "store"


def _in_background() -> bool:
    return threading.current_thread().name == "preheat-executable-prefetch"


def test_slow_store_and_slow_weights_overlap(model_dir, published, tmp_path, monkeypatch):
    pixels, _, store = published
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "fresh-pod"))  # empty: the entry comes from the store
    monkeypatch.setenv("PREHEAT_CACHE_URL", str(store))
    monkeypatch.setenv("PREHEAT_TRUST_REMOTE_CACHE", "1")
    fetch, read = CompileEntries.fetch, TensorInfo.read
    fetching, reading = threading.Event(), threading.Event()
    met: list[str] = []  # which side saw the other begin while it was itself still under way

    def slow_fetch(self, *a, **k):
        fetching.set()
        if reading.wait(RENDEZVOUS_S):
            met.append("fetch")
        return fetch(self, *a, **k)

    def slow_read_bytes(*a, **k):
        if not reading.is_set():  # the first tensor only
            reading.set()
            if fetching.wait(RENDEZVOUS_S):
                met.append("read")
        return read(*a, **k)

    monkeypatch.setattr(CompileEntries, "fetch", slow_fetch)
    monkeypatch.setattr(TensorInfo, "read", slow_read_bytes)
    pipe = preheat.load(model_dir, prefetch=[CALL])
    assert np.array_equal(pipe.generate(**CALL), pixels)
    assert sorted(met) == ["fetch", "read"], met  # the store's fetch and the weight read were under way together
    event = pipe.compiler.events[-1]
    assert event["layer"] == "aot" and event["remote"] == "hit" and event["prefetch"] == "background", event
    spans = pipe.startup.spans
    (pull_start, pull_end), (w_start, w_end) = spans["executable.pull"], spans["weights"]
    assert pull_start < w_end and w_start < pull_end  # the two slow phases ran at the same time
    assert pipe.startup.overlap_s("weights", "executable") > 0
    report = pipe.startup.to_dict()
    assert report["critical_path"][:2] == ["import", "model"] and report["critical_path"][-1] == "first_call"
    assert report["critical_path"][2] in ("weights", "executable")
    assert spans["first_call"][0] >= spans["weights"][1]


def test_failing_background_load_falls_back_to_compile_same_image(model_dir, published, tmp_path, monkeypatch):
    from preheat.cache import serialized

    pixels, home, _ = published
    shutil.copytree(home, tmp_path / "home")
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PREHEAT_CACHE_URL", raising=False)
    load = serialized.load_executable

    def failing(*a, **k):
        if _in_background():
            raise RuntimeError("injected: cannot load this executable")
        return load(*a, **k)

    monkeypatch.setattr(serialized, "load_executable", failing)
    pipe = preheat.load(model_dir, prefetch=[CALL])
    assert np.array_equal(pipe.generate(**CALL), pixels)
    event = pipe.compiler.events[-1]
    assert event["prefetch"] == "background" and "injected" in event["quarantined"], event
    assert event["layer"] in ("none", "xla") and event["trace_lower_s"] > 0  # compiled afresh
    assert "executable" in pipe.startup.spans


def test_crashed_background_thread_loads_on_the_first_call(model_dir, published, tmp_path, monkeypatch):
    from preheat.cache.compile import JaxCompiler

    pixels, home, _ = published
    shutil.copytree(home, tmp_path / "home")
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PREHEAT_CACHE_URL", raising=False)
    load = JaxCompiler._load

    def crashing(self, *a, **k):
        if _in_background():
            raise MemoryError("injected")
        return load(self, *a, **k)

    monkeypatch.setattr(JaxCompiler, "_load", crashing)
    pipe = preheat.load(model_dir, prefetch=[CALL])
    assert np.array_equal(pipe.generate(**CALL), pixels)
    event = pipe.compiler.events[-1]
    assert event["layer"] == "aot" and "injected" in event["prefetch"], event  # loaded here instead


def test_a_cold_prefetch_compiles_every_stage_in_the_background(model_dir, published, tmp_path, monkeypatch):
    """Nothing cached: the rehearsed programs compile on the prefetch's threads (a text family's
    encode, denoise and decode at once), while the weights are read; the first call takes them."""
    pixels, _, _ = published
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "cold"))
    monkeypatch.delenv("PREHEAT_CACHE_URL", raising=False)
    pipe = preheat.load(model_dir, prefetch=[CALL])
    assert np.array_equal(pipe.generate(**CALL), pixels)
    events = pipe.compiler.events
    assert events and all(e["prefetch"] == "background" and e.get("background_compile") == "done"
                                    and "miss" in e and e["layer"] in ("none", "xla") for e in events), events
    assert "executable.compile" in pipe.startup.spans
    again = preheat.load(model_dir, prefetch=[CALL])  # stored as they compiled: the next start loads them
    assert np.array_equal(again.generate(**CALL), pixels)
    assert all(e["layer"] == "aot" for e in again.compiler.events), again.compiler.events


def test_background_compiles_setting(model_dir, published, tmp_path, monkeypatch):
    """``PREHEAT_BACKGROUND_COMPILES=0``: a cold prefetching start compiles on the first call, as
    before; a value that is not a count is refused in one line."""
    from preheat.errors import InvalidArgumentError

    pixels, _, _ = published
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "cold"))
    monkeypatch.delenv("PREHEAT_CACHE_URL", raising=False)
    monkeypatch.setenv("PREHEAT_BACKGROUND_COMPILES", "0")
    pipe = preheat.load(model_dir, prefetch=[CALL])
    assert np.array_equal(pipe.generate(**CALL), pixels)
    events = pipe.compiler.events
    assert events and all("background_compile" not in e and e["layer"] in ("none", "xla") for e in events), events
    monkeypatch.setenv("PREHEAT_BACKGROUND_COMPILES", "many")
    with pytest.raises(InvalidArgumentError, match="PREHEAT_BACKGROUND_COMPILES"):
        preheat.load(model_dir, prefetch=[CALL])


def test_without_prefetch_the_phases_are_sequential(model_dir, published, tmp_path, monkeypatch):
    _, home, _ = published
    shutil.copytree(home, tmp_path / "home")
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PREHEAT_CACHE_URL", raising=False)
    pipe = preheat.load(model_dir)
    pipe.generate(**CALL)
    assert "executable" not in pipe.startup.spans
    assert pipe.startup.critical_path() == ["import", "weights", "first_call"]


def test_prefetched_weights_are_placeholders_until_read(model_dir):
    """With LoadOptions(pending=...) the State holds shapes only; run() fills the same Variables in place."""
    import jax
    from flax import nnx

    from preheat.models.loading import build_abstract, read_unet_config, resolve_unet_dir

    unet_dir = resolve_unet_dir(Path(model_dir))
    _, abstract = build_abstract(read_unet_config(unet_dir))
    tensors = safetensors_files.read_tensors(safetensors_files.weight_files(unet_dir))
    pending = weights.DeferredFills()
    state = weights.fill(abstract, tensors, "float32", "test", options=weights.LoadOptions(pending=pending))
    leaves = [v.get_value() for _, v in nnx.to_flat_state(state)]
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves) and len(pending.jobs) == 1
    pending.run()
    filled = [v.get_value() for _, v in nnx.to_flat_state(state)]
    assert all(isinstance(x, jax.Array) for x in filled)
    assert [(x.shape, x.dtype) for x in filled] == [(x.shape, x.dtype) for x in leaves]
    direct = weights.fill(abstract, tensors, "float32", "test")
    assert all(np.array_equal(a, b.get_value()) for a, (_, b) in zip(filled, nnx.to_flat_state(direct)))


def test_a_server_prefetches_its_warm_declaration(model_dir, published, tmp_path, monkeypatch):
    """``preheat serve`` loads with its warm declaration as prefetch (``preheat.warm.prefetch_calls``):
    the warm-up finds every cached program loaded in the background; one not cached compiles."""
    from preheat.server.core import Core, CoreConfig

    _, home, _ = published
    shutil.copytree(home, tmp_path / "home")
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PREHEAT_CACHE_URL", raising=False)
    # buckets 1 and 2, guided at the model's default: bucket 2 is CALL's program (labels, steps are data;
    # CALL ran without a progress callback, so the server declares programs without step progress)
    config = CoreConfig(model=str(model_dir), max_batch_size=2, samplers=("euler",), guidance=("on",), batch_wait_ms=0,
                        progress=False)
    core = Core(config).start()  # the real loader (server.config.load_pipeline)
    try:
        assert core.wait_setup(300) and core.status == "READY", core.setup.logs
        events = core.pipe.compiler.events
        assert [e.get("prefetch") for e in events] == ["background", "background"], events
        assert events[0]["layer"] in ("none", "xla") and "miss" in events[0]  # bucket 1: not cached, compiled
        assert events[1]["layer"] == "aot" and events[1]["trace_lower_s"] == 0.0  # bucket 2: loaded in the background
    finally:
        core.close()
