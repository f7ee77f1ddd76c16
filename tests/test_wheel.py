"""The README's install from a built wheel works as written: the wheel builds offline, carries the
built-in model, installs into a clean venv with no registry, and `preheat sample` runs from the
installed copy (not from the source tree)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from tests._support.clean_env import clean_venv, offline_env

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "preheat"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel --no-deps .` on a copy of the tree (so the checkout gets no build/ folder)."""
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(tmp / "dist"), str(tree)],
                          env=offline_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (built,) = (tmp / "dist").glob("preheat-*.whl")
    return built


def test_wheel_ships_the_builtin_model_and_every_module(wheel):
    with zipfile.ZipFile(wheel) as zf:
        packed = {n: _sha(zf.read(n)) for n in zf.namelist() if n.startswith("preheat/")}
    tree = {f"preheat/{p.relative_to(SRC)}": _sha(p.read_bytes()) for p in SRC.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    assert "preheat/assets/digits/unet/diffusion_pytorch_model.safetensors" in packed
    assert packed == tree  # every module and asset, byte for byte, and nothing else


def test_installed_wheel_samples_from_a_clean_venv_without_network(wheel, tmp_path):
    python = clean_venv(tmp_path, exclude={"preheat"})
    env = offline_env(PREHEAT_HOME=str(tmp_path / "home"))
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", f"{wheel}[torch,bench]"],
                             env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-2000:]

    where = subprocess.run([str(python), "-c", "import json, preheat, preheat.engine as e; "
                            "print(json.dumps([preheat.__file__, str(e.BUILTIN_MODEL)]))"],
                           env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert where.returncode == 0, where.stderr[-2000:]
    module, builtin = (Path(p) for p in json.loads(where.stdout))
    venv = tmp_path / "venv"
    assert venv in module.parents and venv in builtin.parents  # the installed copy, not src/
    weights = builtin / "unet" / "diffusion_pytorch_model.safetensors"
    shipped = SRC / "assets" / "digits" / "unet" / "diffusion_pytorch_model.safetensors"
    assert _sha(weights.read_bytes()) == _sha(shipped.read_bytes())

    out, report = tmp_path / "s.png", tmp_path / "r.json"
    sample = subprocess.run([str(venv / "bin" / "preheat"), "sample", "--n", "2", "--steps", "2", "--class", "3",
                             "--out", str(out), "--save-images", str(tmp_path / "each"), "--report", str(report),
                             "--quiet"],
                            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert sample.returncode == 0, sample.stderr[-2000:]
    r = json.loads(report.read_text())
    assert (r["model"], r["batch"], r["steps"]) == ("built-in:digits", 2, 2)
    images = sorted((tmp_path / "each").iterdir())
    assert len(images) == 2 and out.is_file()
    assert all(Image.open(p).size == (16, 16) for p in images)  # the built-in model's 16x16 digits


# Standard-library names that came after Python 3.10, the floor pyproject.toml declares (``make run``
# and ``pip install .`` work there; the test path needs 3.12): importing one breaks the package on a
# 3.10 pod image, and no interpreter on the CI machine is that old, so the sources are read instead.
_NEWER_THAN_FLOOR = {
    "typing": {"Self", "LiteralString", "Never", "NotRequired", "Required", "TypeVarTuple", "Unpack",
               "assert_never", "assert_type", "reveal_type", "dataclass_transform", "get_overloads",
               "clear_overloads", "override", "TypeAliasType", "ReadOnly", "TypeIs", "NoDefault"},
    "enum": {"StrEnum", "ReprEnum", "verify", "EnumCheck", "member", "nonmember", "global_enum"},
    "datetime": {"UTC"},
    "asyncio": {"TaskGroup", "timeout", "timeout_at", "Runner", "Barrier"},
}
_MODULES_NEWER_THAN_FLOOR = {"tomllib", "wsgiref.types"}


def _too_new(tree) -> list[str]:
    """The 3.11+ standard-library imports of one parsed module, as ``module.name``."""
    import ast

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            if node.module in _MODULES_NEWER_THAN_FLOOR:
                found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names if a.name in _NEWER_THAN_FLOOR.get(node.module, ())]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in _MODULES_NEWER_THAN_FLOOR]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.attr in _NEWER_THAN_FLOOR.get(node.value.id, ()):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_the_package_parses_and_imports_nothing_newer_than_its_python_floor():
    import ast
    import re

    floor = re.search(r'requires-python\s*=\s*">=\s*3\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert floor and int(floor.group(1)) == 10  # the table above is written for this floor
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))  # 3.10 grammar
        if found := _too_new(tree):
            offenders[str(path.relative_to(SRC))] = found
    assert offenders == {}
    # the reader sees each form it looks for (a check that could not fail would be no check)
    sample = "from typing import Any, Self\nimport tomllib\nimport enum\nx = enum.StrEnum\n"
    assert _too_new(ast.parse(sample)) == ["typing.Self", "tomllib", "enum.StrEnum"]
