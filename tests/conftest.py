"""Strict JAX for every test: explicit rank promotion, several fake CPU devices (for sharding
tests), and a private cache root so tests never touch the user's ~/.cache."""

from __future__ import annotations

import os
import re

# XLA:CPU's backend optimisation level 1, not 3: the tiny models tests build spend most of their
# first call compiling, and level 1 cuts a tiny SD's compile by about a sixth at the same run speed
# (level 0 cuts more but runs 2x slower). It changes speed, never results (no fast-math either
# way); benchmarks, not tests, measure speed. Child processes inherit it.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# torch's OpenMP pool at one thread: the tests' torch models (the diffusers/transformers references,
# the torch backend) are tiny, and `make test` runs two workers on two cores, so a second OpenMP
# thread only waits at each op's barrier for a core the other worker's XLA compile holds -- a tiny
# SDXL's 4-step reference took 7.7 s at 2 threads on a busy 2-core machine, 0.3 s at 1. Read when
# torch is imported (no test imports it before this file); child processes inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# preheat.load's default is every device; the suite tests the single-device program, and the
# multi-device tests (tests/test_devices.py) choose their devices explicitly.
os.environ.setdefault("PREHEAT_DEVICES", "1")
# A deployment's settings (PREHEAT_SIZES, PREHEAT_MODEL, PREHEAT_CACHE, ...: the server's
# ENV_SETTINGS) are read by `preheat serve` and `warm` (and Runpod and Ray) when a flag is absent:
# none of the user's reaches a test or the processes it starts (PREHEAT_DEVICES is the suite's own,
# above). A test that wants one sets it. The table imports no JAX.
from preheat.server.config import ENV_SETTINGS, env_var  # noqa: E402

for _setting in ENV_SETTINGS:
    if _setting != "devices":
        os.environ.pop(env_var(_setting), None)

import jax  # noqa: E402
import pytest  # noqa: E402

# One compile memo per worker for the whole run, used by every test (tests/_support/compile_memo.py);
# a test or module marked own_compiles compiles for itself.
from tests._support.compile_memo import (  # noqa: E402,F401 (fixtures)
    OWN_COMPILES, _module_own_compiles, _session_compile_memo, _test_own_compiles, one_compile_per_program_fixture)
from tests._support import shared_folders  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def _isolate(mp: pytest.MonkeyPatch, home) -> None:
    mp.setenv("PREHEAT_HOME", str(home))


@pytest.fixture(scope="session", autouse=True)
def _session_cache_root(tmp_path_factory):
    """Never the user's cache, nor a Runpod volume, even for session-scoped fixtures."""
    base = tmp_path_factory.getbasetemp()
    mp = pytest.MonkeyPatch()
    _isolate(mp, base / "preheat-home-session")
    mp.setenv("PREHEAT_RUNPOD_VOLUME", str(base / "no-runpod-volume"))
    mp.setenv("PREHEAT_WORKSPACE", str(base / "no-workspace"))
    shared_folders.set_root(shared_folders.run_root(base))  # tiny model folders, written once per run
    yield
    shared_folders.set_root(None)
    mp.undo()


@pytest.fixture(scope="module", autouse=True)
def _module_cache_root(tmp_path_factory):
    """A module's fixtures share one root of their own, whatever ran before them."""
    mp = pytest.MonkeyPatch()
    _isolate(mp, tmp_path_factory.mktemp("preheat-home-module"))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _private_cache_root(tmp_path_factory, monkeypatch):
    """Each test starts on an empty cache root: no result depends on which test ran first.
    A test that wants a warm cache warms it itself."""
    _isolate(monkeypatch, tmp_path_factory.mktemp("preheat-home"))


# ----------------------------------------------------------------------------------------------
# Balance under `pytest -n 2 --dist loadfile`: a file is the unit of work, and xdist by default
# hands files out most-tests-first, so the few-test, compile-heavy files (parity runs, servers,
# clean venvs) came last and one worker ran alone for minutes at the end. Hand out the heaviest
# files first instead (longest-processing-time-first). A file's cost is its seconds in the last
# run that ran it with the same -m expression (kept in pytest's cache, .pytest_cache, one record per
# tier: `make test-slow` timing a file's slow tests must not set its place in `make test`), else HEAVY_FILES (one measured run,
# for a fresh clone); a file known to neither keeps pytest-randomly's place after the known ones'
# head start, and the tests inside every file keep randomly's order. Only the schedule changes.
# Seconds per file (>= 10 s) of `make test` (not slow, not ray), 2 workers, from round 18's full run
# (2026-12-05 09:43 UTC, 3875 tests, 914 s, an Intel Xeon, nothing else running; pytest's cache):
# relative cost only. Replace with a later quiet run's seconds (.pytest_cache/v/preheat/file_seconds_<tier>).
HEAVY_FILES: dict[str, float] = {
    "tests/families/test_stable_diffusion.py": 81, "tests/samplers/test_sampler_parity.py": 62,
    "tests/families/test_image.py": 59, "tests/families/test_few_step.py": 58,
    "tests/cache/test_compile_cache.py": 50, "tests/families/test_lora.py": 44,
    "tests/families/test_family_contract.py": 43, "tests/families/test_flow_families.py": 42,
    "tests/models/test_unet2d.py": 36, "tests/test_docs.py": 35, "tests/models/test_scaled_fp8.py": 35,
    "tests/families/test_text_inputs.py": 34, "tests/cache/test_remote.py": 34,
    "tests/server/test_text_to_image.py": 34, "tests/test_devices.py": 33, "tests/cache/test_targets.py": 32,
    "tests/cache/test_tpu_targets.py": 30,  # an estimate (52 s alone on a busy 2-core machine), not round 18's
    "tests/samplers/test_start.py": 30, "tests/server/test_image_sd_server.py": 29, "tests/server/test_fuzz.py": 29,
    "tests/models/test_single_file.py": 29, "tests/server/test_lora_server.py": 28, "tests/test_cli.py": 28,
    "tests/models/test_storage.py": 27, "tests/server/test_flow_serving.py": 27,
    "tests/backends/test_torch_compile_cache.py": 27, "tests/models/test_unet2d_condition.py": 27,
    "tests/models/test_published_fetch.py": 25, "tests/families/test_kontext.py": 25,
    "tests/integrations/test_runpod.py": 24, "tests/train/test_text_digits.py": 22, "tests/test_progress.py": 22,
    "tests/models/test_gguf.py": 22, "tests/families/test_flow_inpaint.py": 21,
    "tests/families/test_flow_img2img.py": 21, "tests/families/test_fill.py": 21, "tests/test_engine.py": 21,
    "tests/server/test_sigterm.py": 20, "tests/samplers/test_sampler_runtime.py": 20, "tests/models/test_vae.py": 18,
    "tests/server/test_server.py": 18, "tests/server/test_offered_inputs.py": 17,
    "tests/server/test_idle_retune.py": 16, "tests/doctor/test_doctor_gpu.py": 16, "tests/cache/test_warm.py": 15,
    "tests/server/test_bench.py": 15, "tests/models/test_flux.py": 15, "tests/test_builtin_model.py": 14,
    "tests/test_terminal.py": 14, "tests/models/test_single_file_bundles.py": 14, "tests/test_cli_newcomer.py": 14,
    "tests/models/test_t5.py": 14, "tests/models/test_conv_impl.py": 13, "tests/cache/test_remote_store.py": 13,
    "tests/cache/test_early.py": 12, "tests/server/test_common_inputs.py": 11, "tests/server/test_hardening.py": 11,
    "tests/backends/test_torch_backend.py": 10, "tests/families/test_sdxl_refiner.py": 10,
    "tests/doctor/test_doctor_env.py": 10,
}
_file_seconds: dict[str, float] = {}


def _file_seconds_key(config: pytest.Config) -> str:
    """The cache key of this tier's per-file seconds: one per -m expression."""
    tier = re.sub(r"[^A-Za-z0-9]+", "-", getattr(config.option, "markexpr", "") or "").strip("-") or "all"
    return f"preheat/file_seconds_{tier}"  # a sibling of the old one-tier record (a file), not below it


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{OWN_COMPILES}: compiles every program itself, never through the run's "
                            "compile memo (tests/_support/compile_memo.py)")
    # A renamed or deleted file would silently lose its place in a fresh clone's schedule: refuse.
    missing = sorted(path for path in HEAVY_FILES if not (config.rootpath / path).is_file())
    if missing:
        raise pytest.UsageError(f"tests/conftest.py's HEAVY_FILES lists files that do not exist: {', '.join(missing)}; "
                                "rename or drop them")
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist present: keep the file order below
        config.option.loadscopereorder = False
    absent = _absent_paths(config)
    if absent:
        raise pytest.UsageError(f"file or directory not found: {', '.join(absent)}")


def _absent_paths(config: pytest.Config) -> list[str]:
    """The command line's paths (node ids less their ``::...``) that do not exist. Pytest says so
    itself when it collects, but under xdist (``-n 2``) the controller collects nothing and the
    workers' "not found" is lost: the run said "no tests ran" (exit 5) for every file it was given,
    a mistyped one among them (tests/test_image.py: it is tests/families/test_image.py), and no error."""
    if getattr(config.option, "pyargs", False) or hasattr(config, "workerinput"):
        return []  # module names, not paths; a worker's own collection reports its paths
    here = config.invocation_params.dir
    return [arg for arg in config.args if not (here / arg.split("::", 1)[0]).exists()]


@pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cost = dict(HEAVY_FILES)
    cache = getattr(config, "cache", None)  # absent under -p no:cacheprovider
    if cache is not None:
        cost.update(cache.get(_file_seconds_key(config), {}))
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)

    def key(item: pytest.Item) -> tuple[float, int]:
        path = item.nodeid.split("::", 1)[0]
        return (-cost.get(path, 0.0), first[path])

    items.sort(key=key)  # stable: the order inside each file is untouched


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    cache = getattr(session.config, "cache", None)
    if cache is None or hasattr(session.config, "workerinput") or not _file_seconds:
        return  # the controller (or a run without xdist) records; workers only report
    root = session.config.rootpath
    key = _file_seconds_key(session.config)
    known = {path: s for path, s in cache.get(key, {}).items() if (root / path).is_file()}
    known.update({path: round(seconds, 1) for path, seconds in _file_seconds.items()})
    cache.set(key, known)
