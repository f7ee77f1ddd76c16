from __future__ import annotations

from pathlib import Path

import pytest

from tests._support.doctor_fixtures import Machine


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Machine:
    return Machine(tmp_path / "machine", monkeypatch)
