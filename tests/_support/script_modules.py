"""A script under scripts/ as a module, for tests of its functions (scripts are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py``, imported once as ``scripts.<name>``."""
    if f"scripts.{name}" in sys.modules:
        return sys.modules[f"scripts.{name}"]
    spec = importlib.util.spec_from_file_location(f"scripts.{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while the class is built)
    spec.loader.exec_module(module)
    return module
