"""The toy families of ``tests/families/toy/family.py`` as model folders: the built-in digits
model's weights under a pipeline class name that ``preheat.families`` maps to the toy loader
(registered for the caller's test, through ``monkeypatch`` or a ``pytest.MonkeyPatch``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from preheat.engine import BUILTIN_MODEL

TOYS = {"ToyPipeline": "load_toy", "ToyImagePipeline": "load_toy_image"}


def toy_folder(out: Path, monkeypatch: pytest.MonkeyPatch, class_name: str = "ToyImagePipeline") -> Path:
    """A copy of the built-in model at ``out`` whose ``_class_name`` loads as the toy family."""
    import preheat.families as families

    monkeypatch.setitem(families.FAMILY_OF_CLASS, class_name, ("tests.families.toy.family", TOYS[class_name]))
    if not out.exists():
        shutil.copytree(BUILTIN_MODEL, out)
        index = json.loads((out / "model_index.json").read_text())
        (out / "model_index.json").write_text(json.dumps({**index, "_class_name": class_name}))
    return out

