from __future__ import annotations

import pytest

from tests.server.fixtures import _private_env, model_dir, pipe  # noqa: F401  (session fixtures)


@pytest.fixture(scope="session", autouse=True)
def _session_cache_root(tmp_path_factory):
    """Session fixtures (the pipeline, cores warming up in threads) run outside the per-test
    private cache root of tests/conftest.py; give them the same root for the whole session."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _private_env(tmp_path_factory.getbasetemp()).items():
            mp.setenv(key, value)
        yield
