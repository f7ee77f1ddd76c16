from __future__ import annotations

from pathlib import Path

import pytest

from tests._support.doctor_fixtures import Machine


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Machine:
    monkeypatch.delenv("PYTORCH_INDEX_URL", raising=False)  # the fixes print the variable unless it is set
    return Machine(tmp_path / "machine", monkeypatch)
