"""The JAX executable cache: hits, keys, and fault injection (every fault -> same image, quarantined)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import preheat
from preheat.cache.compile import JaxCompiler
from preheat.cache.keys import key_fields, key_of
from tests._support.reference import TINY_CLASS_CONDITIONAL, save_tiny_pipeline

CALL = dict(n=2, steps=3, sampler="euler", seed=7, class_labels=[1, 2])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("m") / "pipe")


@pytest.fixture(scope="module")
def reference_pixels(model_dir):
    return preheat.load(model_dir, cache="off").generate(**CALL)


def _pipe(model_dir, root):
    pipe = preheat.load(model_dir, cache="off")
    pipe.compiler = JaxCompiler(root=root, mode="full")
    return pipe


@pytest.fixture(scope="module")
def warm_template(model_dir, reference_pixels, tmp_path_factory) -> Path:
    """A root holding the one entry a cold full-mode start writes: the fault tests start from a
    copy of it (a fault is injected into a written entry; writing it is
    test_second_process_style_load_hits_aot's to check)."""
    root = tmp_path_factory.mktemp("warm-root")
    pipe = _pipe(model_dir, root)
    assert np.array_equal(pipe.generate(**CALL), reference_pixels)
    assert pipe.last.cache_layer != "aot"
    _entry(root)
    return root


def _warm_root(template: Path, root: Path) -> None:
    """``root`` (empty) becomes a copy of the template: one written, never-hit entry."""
    shutil.copytree(template, root, dirs_exist_ok=True)


def _entry(root: Path) -> Path:
    entries = [p for p in (root / "compile" / "jax").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1, entries
    return entries[0]


def test_second_process_style_load_hits_aot(model_dir, reference_pixels, tmp_path):
    first = _pipe(model_dir, tmp_path)
    assert np.array_equal(first.generate(**CALL), reference_pixels)
    assert first.last.cache_layer in ("none", "xla")
    second = _pipe(model_dir, tmp_path)
    assert np.array_equal(second.generate(**CALL), reference_pixels)
    assert second.last.cache_layer == "aot"
    assert second.last.trace_lower_s == 0.0
    stats = json.loads((_entry(tmp_path) / "stats.json").read_text())
    assert stats["hits"] == 1


def _truncate(entry: Path) -> None:
    f = entry / "executable.bin"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _zero(entry: Path) -> None:
    (entry / "executable.bin").write_bytes(b"")


def _bitflip(entry: Path) -> None:
    f = entry / "executable.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


def _other_jax(entry: Path) -> None:
    m = json.loads((entry / "manifest.json").read_text())
    m["fields"]["jax"] = "0.4.1"
    (entry / "manifest.json").write_text(json.dumps(m))


def _manifest_mismatch(entry: Path) -> None:
    m = json.loads((entry / "manifest.json").read_text())
    m["files"]["executable.bin"]["sha256"] = "0" * 64
    (entry / "manifest.json").write_text(json.dumps(m))


def _crashed_loader(entry: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is now free: a marker naming it is a load that never finished
    import socket

    (entry / f"loading.{socket.gethostname()}.{dead.pid}.12345").write_text("0")


FAULTS = {"truncated": _truncate, "zero-byte": _zero, "bit-flipped": _bitflip, "other-jax-version": _other_jax,
          "manifest-mismatch": _manifest_mismatch, "left-loading": _crashed_loader}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_quarantined_and_image_unchanged(model_dir, reference_pixels, warm_template, tmp_path, fault):
    _warm_root(warm_template, tmp_path)
    entry = _entry(tmp_path)
    FAULTS[fault](entry)
    pipe = _pipe(model_dir, tmp_path)
    out = pipe.generate(**CALL)
    assert np.array_equal(out, reference_pixels)
    event = pipe.compiler.events[-1]
    assert event["layer"] != "aot" and "quarantined" in event, event
    quarantined = list((tmp_path / "quarantine").iterdir())
    assert len(quarantined) == 1 and (quarantined[0] / "QUARANTINED").is_file()
    # The recompile wrote a fresh, verifying entry that the next start hits.
    again = _pipe(model_dir, tmp_path)
    assert np.array_equal(again.generate(**CALL), reference_pixels)
    assert again.last.cache_layer == "aot"


def test_real_crash_during_load_does_not_crash_loop(model_dir, reference_pixels, warm_template, tmp_path):
    """A process killed while deserialising leaves its marker; the next start quarantines."""
    _warm_root(warm_template, tmp_path)
    script = textwrap.dedent(f"""
        import os, signal
        import preheat.cache.serialized as se
        se.load_executable = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        import preheat
        p = preheat.load({str(model_dir)!r})
        p.generate(**{CALL!r})
    """)
    env = {**os.environ, "PREHEAT_HOME": str(tmp_path)}
    crashed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert crashed.returncode == -9
    assert list(_entry(tmp_path).glob("loading.*"))
    pipe = _pipe(model_dir, tmp_path)
    assert np.array_equal(pipe.generate(**CALL), reference_pixels)
    assert "crashed" in pipe.compiler.events[-1]["quarantined"]


def _fields(model_dir, **call):
    pipe = preheat.load(model_dir, cache="off")
    sig, args = pipe.prepare(**{**CALL, **call})
    return key_fields(pipe.fingerprint, sig, args)


def test_key_changes_with_what_changes_the_program(model_dir, tmp_path, monkeypatch):
    base = key_of(_fields(model_dir))
    assert key_of(_fields(model_dir, n=3, class_labels=None)) != base  # batch shape
    assert key_of(_fields(model_dir, sampler="ddim")) != base  # solver
    other_arch = save_tiny_pipeline(tmp_path / "wide", config={**TINY_CLASS_CONDITIONAL, "block_out_channels": (8, 24)})
    assert key_of(_fields(other_arch)) != base  # architecture
    import jax

    monkeypatch.setattr(jax, "__version__", "9.9.9")
    assert key_of(_fields(model_dir)) != base  # jax version


def test_key_is_stable_for_runtime_data_and_fine_tunes(model_dir, tmp_path):
    base = key_of(_fields(model_dir))
    assert key_of(_fields(model_dir, steps=11, seed=3, class_labels=[4, 4])) == base  # runtime data
    assert key_of(_fields(model_dir, sampler="dpmpp_2m")) == key_of(_fields(model_dir, sampler="dpmpp_2m_karras"))
    tuned = save_tiny_pipeline(tmp_path / "tuned", seed=123)  # same architecture, other weights
    assert key_of(_fields(tuned)) == base


def test_key_is_stable_across_processes(model_dir):
    script = textwrap.dedent(f"""
        import preheat
        from preheat.cache.keys import key_fields, key_of
        p = preheat.load({str(model_dir)!r}, cache="off")
        sig, args = p.prepare(**{CALL!r})
        print(key_of(key_fields(p.fingerprint, sig, args)))
    """)
    keys = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(i)}).stdout.strip() for i in range(2)}
    assert len(keys) == 1 and key_of(_fields(model_dir)) in keys


@pytest.mark.slow
def test_six_concurrent_cold_starts_share_one_entry(model_dir, reference_pixels, tmp_path):
    script = textwrap.dedent(f"""
        import numpy as np, preheat
        p = preheat.load({str(model_dir)!r})
        out = p.generate(**{CALL!r})
        np.save(__import__("sys").argv[1], out)
    """)
    env = {**os.environ, "PREHEAT_HOME": str(tmp_path / "root")}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / f"out{i}.npy")], env=env) for i in range(6)]
    assert [p.wait(timeout=300) for p in procs] == [0] * 6
    for i in range(6):
        assert np.array_equal(np.load(tmp_path / f"out{i}.npy"), reference_pixels)
    jax_dir = tmp_path / "root" / "compile" / "jax"
    assert len([p for p in jax_dir.iterdir()]) == 1  # one entry, no temp folders left
    from preheat.cache.manage import verify_entries

    assert all(info.ok for info in verify_entries(tmp_path / "root"))


def test_size_cap_evicts_least_recently_used(model_dir, warm_template, tmp_path, monkeypatch):
    _warm_root(warm_template, tmp_path)
    pipe = _pipe(model_dir, tmp_path)
    first = _entry(tmp_path).name
    size = sum(f.stat().st_size for f in (tmp_path / "compile" / "jax" / first).iterdir())
    monkeypatch.setenv("PREHEAT_CACHE_MAX_GB", str(1.5 * size / 1e9))  # room for one entry only
    pipe.generate(**{**CALL, "sampler": "ddim"})
    names = [p.name for p in (tmp_path / "compile" / "jax").iterdir()]
    assert first not in names and len(names) == 1


def _xla_warm_then_full(model_dir, reference_pixels, tmp_path, **env: str) -> list[list[dict]]:
    """Three fresh processes on one root: "xla" (fills JAX's persistent cache only), then "full"
    twice (an aot miss on a warm xla layer, then the entry it wrote); each one's cache events."""
    script = textwrap.dedent(f"""
        import json, sys, numpy as np, preheat
        p = preheat.load({str(model_dir)!r}, cache=sys.argv[1])
        out = p.generate(**{CALL!r})
        np.save(sys.argv[2], out)
        print(json.dumps(p.compiler.events, default=str))
    """)
    env = {**os.environ, "PREHEAT_HOME": str(tmp_path / "root"), **env}

    def start(mode: str, name: str) -> list[dict]:
        r = subprocess.run([sys.executable, "-c", script, mode, str(tmp_path / name)], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert np.array_equal(np.load(tmp_path / name), reference_pixels)  # whatever the cache did
        return json.loads(r.stdout.strip().splitlines()[-1])

    return [start("xla", "a.npy"), start("full", "b.npy"), start("full", "c.npy")]


def _xla_warm_then_full_here(model_dir, reference_pixels, root: Path, monkeypatch) -> list[list[dict]]:
    """The same three starts as loads in this process: JAX's persistent cache is read here as in a
    fresh process (each load lowers its programs anew, and JAX looks each up in the cache's
    directory: test_each_root_has_its_own_xla_layer's "first again" is such a hit, and the guard-off
    switch serves the miss from it here too). Each one's cache events."""
    monkeypatch.setenv("PREHEAT_HOME", str(root))
    events = []
    for mode in ("xla", "full", "full"):
        pipe = preheat.load(model_dir, cache=mode)
        assert np.array_equal(pipe.generate(**CALL), reference_pixels)  # whatever the cache did
        events.append(list(pipe.compiler.events))
    return events


def test_an_xla_warm_root_upgraded_to_full_mode_writes_a_working_entry(model_dir, reference_pixels, tmp_path,
                                                                         monkeypatch):
    """JAX's persistent cache holds the program, the executable layer does not (an "xla"-mode root,
    or a quarantined entry): the full-mode start must compile a program that survives
    serialisation. (On XLA:CPU an executable loaded from JAX's cache does not: the next test, in
    fresh processes as a fleet starts them.) Here the three starts are loads in one process: what
    is checked is the guard's decision at the aot miss, which reads JAX's cache on disk either way."""
    fill, miss, hit = _xla_warm_then_full_here(model_dir, reference_pixels, tmp_path / "root", monkeypatch)
    assert fill[-1]["layer"] == "none"  # fills JAX's persistent cache only
    assert (miss[-1]["layer"], miss[-1]["store"]) == ("none", "written")  # xla warm, aot empty: compiled fresh
    assert [e["layer"] for e in hit] == ["aot"]  # and the entry it wrote runs


def test_the_serialise_guard_off_on_the_cpu_stores_an_entry_that_fails_its_first_run(model_dir, reference_pixels,
                                                                                     tmp_path):
    """Why the guard is on for "cpu" (not in XLA_SERIALISE_SAFE_PLATFORMS), and that the diagnostic switch
    (PREHEAT_XLA_SERIALISE_GUARD=off, what the GPU check's row 8 runs with) really lifts it: the
    aot miss is served by JAX's cache and stored, and the next process's entry loads but fails on
    its first run with XLA:CPU's "Function ... not found", is quarantined and recompiled."""
    fill, miss, hit = _xla_warm_then_full(model_dir, reference_pixels, tmp_path, PREHEAT_XLA_SERIALISE_GUARD="off")
    assert fill[-1]["layer"] == "none"
    assert (miss[-1]["layer"], miss[-1]["store"]) == ("xla", "written")  # a load, not a compile, and stored
    assert hit[0]["layer"] == "aot"  # it deserialises ...
    (bad,) = [e for e in hit if "quarantined" in e]  # ... but does not run
    assert bad["quarantined"].startswith("failed on its first run: NOT_FOUND: Function ")
    assert "_fusion not found" in bad["quarantined"]
    assert len(list((tmp_path / "root" / "quarantine").iterdir())) == 1


def test_the_serialise_guard_is_lifted_for_cuda_alone(monkeypatch):
    """Row 8 measured CUDA (an H200): an entry served by JAX's cache ran in a new process with the
    same pixels. A GPU key without a CUDA plugin (ROCm) and the CPU keep the guard; the diagnostic
    switch still lifts it everywhere."""
    from preheat.cache.compile import SERIALISE_GUARD_ENV, serialise_guard

    cuda = {"platform": "gpu", "cuda": {"jax-cuda13-plugin": "0.11.2", "nvidia-cudnn-cu13": "9.19.0.56"}}
    monkeypatch.delenv(SERIALISE_GUARD_ENV, raising=False)
    assert not serialise_guard(cuda)
    assert serialise_guard({"platform": "gpu", "cuda": {}}) and serialise_guard({"platform": "cpu"})
    monkeypatch.setenv(SERIALISE_GUARD_ENV, "off")
    assert not serialise_guard({"platform": "cpu"})


def test_an_entry_that_loads_but_fails_to_run_is_quarantined(model_dir, reference_pixels, warm_template, tmp_path,
                                                               monkeypatch):
    """The last line of defence: an executable that deserialises but raises on its first run."""
    import jax

    from preheat.cache import compile as compile_mod

    _warm_root(warm_template, tmp_path)
    real_load = compile_mod.JaxCompiler._load

    def load_a_broken_program(self, *a, **k):
        compiled = real_load(self, *a, **k)
        if compiled is None:
            return None

        def broken(*args):
            raise jax.errors.JaxRuntimeError("NOT_FOUND: Function fusion not found (type id: 1)")

        return broken

    monkeypatch.setattr(compile_mod.JaxCompiler, "_load", load_a_broken_program)
    pipe = _pipe(model_dir, tmp_path)
    assert np.array_equal(pipe.generate(**CALL), reference_pixels)
    assert any("failed on its first run" in e.get("quarantined", "") for e in pipe.compiler.events)
    assert len(list((tmp_path / "quarantine").iterdir())) == 1


def test_cache_off_neither_reads_nor_writes_jaxs_persistent_cache(model_dir):
    """JAX's persistent cache directory is process-wide once a full or xla load set it: a
    ``cache="off"`` load after one must not write its programs there (it wrote them, and read
    them back as hits reported as "none"). Control: the "xla" compile before it does."""
    xla = preheat.load(model_dir, cache="xla")
    xla.generate(n=6, steps=1, seed=0)
    xla_dir = xla.compiler.root / "compile" / "xla"

    def files() -> set[Path]:
        return {p for p in xla_dir.rglob("*") if p.is_file()}

    before = files()
    assert len(before) >= 1, "the control: an xla-mode compile writes JAX's cache here"
    off = preheat.load(model_dir, cache="off")
    off.generate(n=5, steps=1, seed=0)  # a batch size no other test compiles
    assert files() == before and off.last.cache_layer == "none"


def test_each_root_has_its_own_xla_layer(model_dir, reference_pixels, tmp_path, monkeypatch):
    """JAX has one persistent-cache directory per process: a second root (another $PREHEAT_HOME)
    read and wrote the first root's ``compile/xla`` (the call below was an xla hit from it, its
    own stayed empty). Each load's programs now land in, and are served from, its own root."""
    first, second = tmp_path / "first", tmp_path / "second"
    layers = {}
    for name, root in (("first", first), ("second", second), ("first again", first)):
        monkeypatch.setenv("PREHEAT_HOME", str(root))
        pipe = preheat.load(model_dir, cache="xla")
        assert np.array_equal(pipe.generate(**CALL), reference_pixels)
        assert pipe.compiler.root == root
        layers[name] = pipe.last.cache_layer
    assert layers == {"first": "none", "second": "none", "first again": "xla"}
    for root in (first, second):
        assert any(p.is_file() for p in (root / "compile" / "xla").rglob("*")), f"{root.name}'s compile/xla is empty"
