"""Strict JAX for every test: explicit rank promotion, several fake CPU devices (for sharding
tests), and a private cache root so tests never touch the user's ~/.cache."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# preheat.load's default is every device; the suite tests the single-device program, and the
# multi-device tests (tests/test_devices.py) choose their devices explicitly.
os.environ.setdefault("PREHEAT_DEVICES", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

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
    yield
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
