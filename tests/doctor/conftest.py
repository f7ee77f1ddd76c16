from __future__ import annotations

from pathlib import Path

import pytest

from tests.doctor.helpers import Machine


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Machine:
    return Machine(tmp_path / "machine", monkeypatch)
