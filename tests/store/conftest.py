"""Fixtures for the store tests: a real HTTP server on 127.0.0.1 and a small diffusers-format
folder. Every test gets its own store root (``tmp_path / "home"``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._support.store_fixtures import make_model
from tests._support.file_server import FileServer


@pytest.fixture
def server():
    srv = FileServer().start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "src-model")
