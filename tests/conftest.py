"""Strict JAX for every test: explicit rank promotion, several fake CPU devices (for sharding
tests), and a private cache root so tests never touch the user's ~/.cache."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _private_cache_root(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.getbasetemp() / "preheat-home"
    monkeypatch.setenv("PREHEAT_HOME", str(home))
    monkeypatch.setenv("PREHEAT_RUNPOD_VOLUME", str(tmp_path_factory.getbasetemp() / "no-runpod-volume"))
    monkeypatch.setenv("PREHEAT_WORKSPACE", str(tmp_path_factory.getbasetemp() / "no-workspace"))
