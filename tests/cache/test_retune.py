"""Autotune-and-replace (``preheat.cache.retune``, issue 29 item 2).

A CPU has no autotuning, so the GPU's trigger (``autotunes_here``) is never faked here. What is
tested instead: the decision as a pure function; the replace path on real entries of this
machine's platform, with the two timings injected (the only thing a CPU cannot produce); the
atomic swap on raw entries, killed at each point between writing and publishing; and that a CPU
process with retuning on leaves its own entries alone.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preheat.cache.executables import Executables
from preheat.cache import retune
from preheat.cache.compile import EXECUTABLE, JaxCompiler
from preheat.cache.entries import iter_entries, open_entry, publish_entry, rewrite_manifest
from preheat.cache.manage import target_label
from preheat.cache.serialized import serialize
from tests._support.clean_env import offline_env

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Sig:
    stage: str = "denoise"
    batch: int = 4


def program(a: jax.Array) -> jax.Array:
    return jnp.tanh(a @ a.T) * 0.5  # (B, B)


def same_program(a: jax.Array) -> jax.Array:
    """The same function under another name: another executable (other bytes), equal results."""
    return program(a)


@pytest.mark.parametrize("old_s, new_s, replace", [
    (10.0, 9.0, True), (10.0, 9.7, True),  # faster by more than the 2% margin
    (10.0, 9.9, False), (10.0, 10.0, False), (10.0, 12.0, False),  # within noise, equal, slower
    (10.0, 0.0, False), (0.0, 1.0, False), (10.0, math.nan, False), (math.nan, 1.0, False),  # no timing
])
def test_decide_replaces_only_when_clearly_faster(old_s, new_s, replace):
    assert retune.decide(old_s, new_s) is replace


def test_needs_retune_only_gpu_entries_never_autotuned_or_retuned():
    gpu = {"fields": {"platform": "gpu"}, "autotuned": False}
    assert retune.needs_retune(gpu)
    assert not retune.needs_retune({**gpu, "autotuned": True})
    assert not retune.needs_retune({**gpu, "retune": {"replaced": False}})  # once only
    assert not retune.needs_retune({"fields": {"platform": "cpu"}, "autotuned": False})  # nothing to autotune
    assert not retune.needs_retune({"autotuned": False})


def test_cache_ls_label_shows_both_timings():
    target = {"name": "h200", "device": "NVIDIA H200 141GB HBM3e"}
    assert target_label({"target": target, "autotuned": False}) == "h200 (not autotuned)"
    tuned = {"deviceless_s": 0.0125, "autotuned_s": 0.0101, "replaced": True, "at": 0}
    assert target_label({"target": target, "autotuned": True, "retune": tuned}) == \
        "h200 (autotuned here: 12.5 ms deviceless, 10.1 ms autotuned)"
    kept = {**tuned, "autotuned_s": 0.0127, "replaced": False}
    assert target_label({"target": target, "autotuned": False, "retune": kept}) == \
        "h200 (kept: 12.5 ms deviceless, 12.7 ms autotuned)"
    assert target_label({"autotuned": False}) == "local"
    failed = {"failed": "RuntimeError: out of memory", "at": 0}  # a server's idle retune failed
    assert target_label({"target": target, "autotuned": False, "retune": failed}) == \
        "h200 (not autotuned; retune failed: RuntimeError: out of memory)"


@pytest.fixture()
def entry(tmp_path):
    """A real entry of this machine's platform (not autotuned: XLA:CPU has nothing to tune),
    the executable loaded from it, its arguments, and the expected result."""
    args = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    compiler = JaxCompiler(root=tmp_path / "root", remote=None)
    compiler.get_or_compile({"model": "retune-test"}, Sig(), program, args)  # compiles and stores
    (event,) = compiler.events
    path = compiler.kind_dir / event["key"]
    reader = JaxCompiler(root=tmp_path / "root", remote=None)
    served, timings = reader.get_or_compile({"model": "retune-test"}, Sig(), program, args)
    assert timings.cache_layer == "aot"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["autotuned"] is False
    return path, served, args, np.asarray(jax.jit(program)(args)), manifest  # a fresh compile: bitwise


def _timer(seconds: dict[int, float]):
    """Injected timings, per executable (the one thing a CPU cannot measure meaningfully)."""
    return lambda executable, args: seconds[id(executable)]


def test_a_faster_compile_replaces_the_entry_and_records_both_timings(entry):
    path, served, args, expected, before = entry
    rewrite_manifest(path, {**before, "signature": {"mac": "0" * 64}})  # as a pulled, signed entry has
    tuned = jax.jit(same_program).lower(args).compile()
    payload = serialize(tuned)
    assert payload != (path / EXECUTABLE).read_bytes()  # so that the swap is visible

    chosen, result = retune.retune_entry(path, served, tuned, {EXECUTABLE: payload}, args,
                                         timer=_timer({id(served): 0.0125, id(tuned): 0.0100}))
    assert chosen is tuned and result.replaced
    assert (result.deviceless_s, result.autotuned_s) == (0.0125, 0.0100)
    after = open_entry(path.parent, path.name, before["fields"])  # verifies sha256s against the new manifest
    assert after.manifest["autotuned"] is True
    assert after.manifest["retune"] == result._asdict()
    assert after.manifest["fields"] == before["fields"] and after.manifest["target"] == before["target"]
    assert "signature" not in after.manifest
    assert (path / EXECUTABLE).read_bytes() == payload
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing left beside it

    # a fresh process's load serves the replacement, with the same results, and needs no retune
    reader = JaxCompiler(root=path.parents[2], remote=None)
    loaded, timings = reader.get_or_compile({"model": "retune-test"}, Sig(), program, args)
    assert timings.cache_layer == "aot"
    np.testing.assert_array_equal(np.asarray(loaded(args)), expected)


@pytest.mark.parametrize("tuned_s", [0.0125, 0.0124, 0.0200])  # equal, within the margin, slower
def test_an_autotuned_compile_that_is_not_faster_leaves_the_executable_alone(entry, tuned_s):
    path, served, args, expected, before = entry
    rewrite_manifest(path, {**before, "signature": {"mac": "0" * 64}})  # as a pulled, signed entry has
    bytes_before = (path / EXECUTABLE).read_bytes()
    tuned = jax.jit(same_program).lower(args).compile()

    chosen, result = retune.retune_entry(path, served, tuned, {EXECUTABLE: serialize(tuned)}, args,
                                         timer=_timer({id(served): 0.0125, id(tuned): tuned_s}))
    assert chosen is served and not result.replaced
    assert (path / EXECUTABLE).read_bytes() == bytes_before
    after = open_entry(path.parent, path.name, before["fields"])
    # the timings recorded, the store's signature (of the manifest as it was) dropped, nothing else changed
    assert after.manifest == {**before, "retune": result._asdict()}
    assert not retune.needs_retune({**after.manifest, "fields": {"platform": "gpu"}})  # retuned once
    np.testing.assert_array_equal(np.asarray(chosen(args)), expected)


def test_time_call_measures_a_real_call(entry):
    path, served, args, expected, before = entry
    seconds = retune.time_call(served, args, repeats=3)
    assert 0 < seconds < 60


def test_retuning_on_a_cpu_leaves_local_entries_alone(entry):
    path, served, args, expected, before = entry
    compiler = JaxCompiler(root=path.parents[2], remote=None)
    compiler.retune = True  # as `preheat warm` sets it
    assert not retune.autotunes_here()  # the CPU: this process cannot autotune, and says so
    loaded, timings = compiler.get_or_compile({"model": "retune-test"}, Sig(), program, args)
    assert timings.cache_layer == "aot" and "retune" not in compiler.events[-1]
    assert json.loads((path / "manifest.json").read_text()) == before


# --- the swap itself, killed at each point (a child process that dies by os._exit: no finally runs)

_CHILD = """
import os, sys
from pathlib import Path
from preheat.cache import entries
kind_dir, where = Path(sys.argv[1]), sys.argv[2]
die = lambda *a, **k: os._exit(9)
if where == "before-swap":          # the new entry written complete, not yet published
    entries._exchange = die
elif where == "between-renames":    # a filesystem without exchange: the old entry renamed aside
    entries._exchange = lambda a, b: False
    real = os.rename
    calls = []
    def rename(a, b):
        calls.append(a)
        if len(calls) == 2:
            os._exit(9)
        return real(a, b)
    entries.os.rename = rename
entries.replace_entry(kind_dir, "k" * 32, {"executable.bin": b"new" * 100}, {"f": 1}, extra={"autotuned": True})
"""


@pytest.mark.parametrize("where", ["before-swap", "between-renames", "completes", "completes-without-exchange"])
def test_replacing_an_entry_is_atomic_wherever_it_is_killed(tmp_path, where):
    kind_dir = tmp_path / "compile" / "jax"
    key = "k" * 32
    publish_entry(kind_dir, key, {"executable.bin": b"old" * 100}, {"f": 1}, extra={"autotuned": False})
    child = _CHILD
    if where == "completes-without-exchange":
        child = child.replace('where = Path(sys.argv[1]), sys.argv[2]',
                              'where = Path(sys.argv[1]), sys.argv[2]\nentries._exchange = lambda a, b: False')
    proc = subprocess.run([sys.executable, "-c", child, str(kind_dir), where], capture_output=True, text=True,
                          timeout=120, env=offline_env(PYTHONPATH=str(ROOT / "src")), cwd=ROOT)
    assert proc.returncode == (0 if where.startswith("completes") else 9), proc.stderr[-2000:]

    got = open_entry(kind_dir, key, {"f": 1})  # verified: never old files under a new manifest
    if where == "before-swap":
        assert got.file("executable.bin").read_bytes() == b"old" * 100 and got.manifest["autotuned"] is False
    elif where == "between-renames":
        assert got is None  # a miss (the caller compiles), never a mix
    else:
        assert got.file("executable.bin").read_bytes() == b"new" * 100 and got.manifest["autotuned"] is True
    assert [p.name for p in iter_entries(kind_dir)] == ([] if got is None else [key])  # leftovers are .tmp-*
    leftovers = [p.name for p in kind_dir.iterdir() if p.name != key]
    assert all(name.startswith(".tmp-") for name in leftovers)
    assert bool(leftovers) is (not where.startswith("completes"))


def test_warm_says_what_retuning_did():
    from preheat.warm import _retune_note

    tuned = {"deviceless_s": 0.0125, "autotuned_s": 0.0101, "replaced": True, "at": 0}
    assert _retune_note([tuned]) == "; replaced by the autotuned compile: 12.5 -> 10.1 ms"
    assert _retune_note([{**tuned, "autotuned_s": 0.0130, "replaced": False}]) == \
        "; kept (the autotuned compile is not faster): 12.5 -> 13 ms"
    assert _retune_note(["skipped: gpu compiles do not autotune"]) == "; skipped: gpu compiles do not autotune"
    assert _retune_note([]) == ""


def test_idle_retuner_waits_for_idle_retunes_each_entry_once_and_swaps_between_calls(entry, monkeypatch):
    """The server's scheduler (``IdleRetuner``) without a server: nothing starts before the idle
    time; two signatures served from one entry are retuned once; each job is one call; the
    winner replaces the entry and the served executable. (Its own check that the entry still
    needs a retune is told that a CPU entry does: it never would.)"""
    import threading

    monkeypatch.setattr(retune, "needs_retune", lambda m: m.get("autotuned") is False and "retune" not in m)

    path, served, args, expected, before = entry
    compiler = JaxCompiler(root=path.parents[2], remote=None)
    lock = threading.Condition()
    made = []

    def compile_autotuned(program_, args_):
        executable, files = compiler.compile_autotuned(program_, args_)
        made.append(executable)
        return executable, files

    calls = []

    def timer(executable, args_):
        calls.append(executable)
        return 0.0100 if executable in made else 0.0125

    retuner = retune.IdleRetuner(idle_s=5.0, lock=lock, timer=timer, repeats=3)
    executables = Executables()
    for sig in (Sig(), Sig(batch=8)):
        executables.put(sig, served)
    candidates = [retune.Candidate(path.name, path, sig, program, args, served) for sig in executables.signatures()]
    retuner.bind(candidates, executables, compile_autotuned)
    assert retuner.waiting == 1  # one entry
    with lock:
        assert retuner.wait_s(idle_for=1.0) == 4.0 and retuner.next_task(idle_for=1.0) is None
        assert retuner.next_task(idle_for=5.0) is None  # the compile starts, on its own thread
        assert retuner.busy and retuner.wait_s(idle_for=5.0) is None  # until it notifies
        assert lock.wait_for(lambda: retuner.compiled, 120)
    jobs = 0
    while retuner.busy:
        with lock:
            task = retuner.next_task(idle_for=0.0)  # once compiled, a job needs no idle time
        task()
        jobs += 1
    assert jobs == 2 + 2 * 3 + 1 and len(calls) == 2 + 2 * 3  # the untimed pair, 3 timed pairs, the decision
    assert retuner.stats == {"replaced": 1, "kept": 0, "failed": 0, "canceled": 0}
    assert executables.get(Sig()) is made[0] and executables.get(Sig(batch=8)) is served  # the one it was taken for
    assert retuner.waiting == 0
    with lock:
        assert retuner.next_task(idle_for=60.0) is None and len(made) == 1
    assert candidates == []  # the second signature's candidate: the same entry, dropped (and not held)
    assert json.loads((path / "manifest.json").read_text())["retune"]["replaced"] is True
    np.testing.assert_array_equal(np.asarray(executables.get(Sig())(args)), expected)


def _needs_retune_any_platform(manifest: dict) -> bool:
    """``needs_retune`` without its GPU-only clause: a CPU entry is never autotuned either."""
    return manifest.get("autotuned") is False and "retune" not in manifest


def test_a_failed_retune_under_preheat_warm_is_recorded_in_the_entry_as_a_servers_is(tmp_path, monkeypatch):
    """`preheat warm` on the built-in model writes real CPU entries; a second `preheat warm`, told
    that this backend autotunes and that CPU entries need it, has its autotuned compile fail: the
    failure is in each entry's manifest (``retune.record_failure``, the function a server's idle
    retune calls), so `cache ls` and `cache explain` show it, and the next `preheat warm` does not
    try again."""
    from click.testing import CliRunner

    from preheat.cli import main

    root = tmp_path / "root"
    monkeypatch.setenv("PREHEAT_HOME", str(root))
    monkeypatch.delenv("PREHEAT_CACHE_URL", raising=False)
    warm = ["warm", "--max-batch-size", "1"]
    first = CliRunner().invoke(main, warm, catch_exceptions=False)
    assert first.exit_code == 0, first.output
    paths = list(iter_entries(root / "compile" / "jax"))
    before = {p.name: json.loads((p / "manifest.json").read_text()) for p in paths}
    assert paths and all(m["autotuned"] is False and "retune" not in m for m in before.values())

    monkeypatch.setattr(retune, "autotunes_here", lambda: True)
    monkeypatch.setattr(retune, "needs_retune", _needs_retune_any_platform)
    attempts = []

    def compile_autotuned(self, program_, args_):
        attempts.append(program_)
        raise RuntimeError("out of memory while autotuning\nsecond line")

    monkeypatch.setattr(JaxCompiler, "compile_autotuned", compile_autotuned)
    second = CliRunner().invoke(main, warm, catch_exceptions=False)
    assert second.exit_code == 0, second.output
    message = "RuntimeError: out of memory while autotuning"
    assert len(attempts) == len(paths)  # every entry it served from was tried once
    assert second.output.count(f"(cache: aot); failed: {message}") == len(paths), second.output
    for path in paths:
        after = json.loads((path / "manifest.json").read_text())
        assert after["retune"]["failed"] == message and after["retune"]["at"] > 0
        assert {k: v for k, v in after.items() if k != "retune"} == before[path.name]  # the executable stays
        assert open_entry(path.parent, path.name, before[path.name]["fields"]) is not None  # verified

    said = f"local (not autotuned; retune failed: {message})"
    listed = CliRunner().invoke(main, ["cache", "ls"], env={"COLUMNS": "400"})
    assert listed.exit_code == 0 and " ".join(listed.output.split()).count(said) == len(paths), listed.output
    explained = CliRunner().invoke(main, ["cache", "explain", "--n", "1"])
    assert explained.exit_code == 0 and f"(target {said})" in explained.output, explained.output

    third = CliRunner().invoke(main, warm, catch_exceptions=False)  # failed once: not retried on every start
    assert third.exit_code == 0 and len(attempts) == len(paths) and "failed:" not in third.output, third.output
