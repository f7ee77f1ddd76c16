"""The test tree's own layout: shared helpers live in ``tests/_support``, and no test module imports
another test module (a helper buried in a test file drags that file's fixtures and collection into
every importer, and breaks when the file is renamed). Read from the source, including the child
programs that tests run from a string (``python -c``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SUPPORT = "tests._support"
_IN_TEXT = re.compile(r"^\s*(?:from\s+(tests(?:\.\w+)*)\s+import|import\s+(tests(?:\.\w+)*))", re.M)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = TESTS.parent) -> list[tuple[int, str]]:
    """(line, module) for every ``tests...`` module this file imports, in code or in a child's source."""
    module = module_name(path, root)
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = module.split(".")[: -node.level] if path.name != "__init__.py" else module.split(".")
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source == "tests" or (node.level and not node.module):  # from tests / . import x: x is a module
                found += [(node.lineno, f"{source}.{a.name}") for a in node.names]
            elif source.startswith("tests."):
                found.append((node.lineno, source))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for m in _IN_TEXT.finditer(node.value):
                found.append((node.lineno, m.group(1) or m.group(2)))
    return found


def bad_imports() -> list[str]:
    out = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == Path(__file__).resolve():  # its probe below is text, not imports
            continue
        for line, imported in imports_of(path):
            if imported != SUPPORT and not imported.startswith(SUPPORT + "."):
                out.append(f"{path.relative_to(TESTS.parent)}:{line}: imports {imported}")
    return out


def test_test_modules_import_only_the_support_package():
    bad = bad_imports()
    assert not bad, "move shared helpers into tests/_support and import them from there:\n" + "\n".join(bad)


def test_the_reader_sees_every_kind_of_import(tmp_path):
    """Each form a test could use to reach another test module is found (else the check proves nothing)."""
    pkg = tmp_path / "tests" / "pkg"
    pkg.mkdir(parents=True)
    probe = pkg / "test_probe.py"
    probe.write_text("import tests.a\nfrom tests.b import x\nfrom tests import c\nfrom . import d\nfrom .e import y\n"
                     "def f():\n    from tests._support.g import z\n"
                     "CHILD = '''\nimport sys\nfrom tests.h import w\n'''\n")
    assert [m for _, m in imports_of(probe, tmp_path)] == ["tests.a", "tests.b", "tests.c", "tests.pkg.d", "tests.pkg.e",
                                                   "tests._support.g", "tests.h"]


def test_helpers_are_not_test_modules():
    """The support package holds no tests (pytest would collect them under a helper's name)."""
    named = sorted(p.name for p in (TESTS / "_support").glob("test_*.py"))
    assert not named, f"tests/_support holds test files: {named}"


def test_files_given_together_are_all_collected_and_a_missing_one_is_an_error():
    """Every file on the command line is collected, and a path that does not exist is an error
    naming it with xdist too (``-n 2``, as ``make test`` runs): there, the controller collects
    nothing and the workers' "not found" was lost -- "no tests ran", exit 5, for all the files
    given (tests/conftest.py's ``_absent_paths``)."""
    import subprocess
    import sys

    def pytest(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", *args],
                              cwd=TESTS.parent, capture_output=True, text=True, timeout=300)

    both = pytest("--collect-only", "-q", "tests/test_image_input.py", "tests/test_test_layout.py")
    assert both.returncode == 0, both.stdout + both.stderr
    assert {line.split("::")[0] for line in both.stdout.splitlines() if "::" in line} == {
        "tests/test_image_input.py", "tests/test_test_layout.py"}, both.stdout
    # pytest alone says so itself; under xdist, only the conftest's check does
    missing = pytest("-n", "2", "--dist", "loadfile", "tests/test_image_input.py", "tests/test_image.py")
    said = missing.stdout + missing.stderr  # tests/test_image.py: it is tests/families/test_image.py
    assert missing.returncode == 4 and "file or directory not found: tests/test_image.py" in said, said


def test_the_compile_memo_is_one_per_run_and_absent_where_a_test_compiles_its_own(tmp_path):
    """tests/_support/compile_memo.py, registered by tests/conftest.py: one memo for every test of a
    run (a worker), none for a test marked ``own_compiles`` nor for a marked module's tests and
    module fixtures, and the same memo again for the tests after them: run in that order, each test
    (and the marked module's fixture) writes the memo its compiles go through."""
    import os
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(
        "from tests._support.compile_memo import (  # noqa: F401\n"
        "    OWN_COMPILES, _module_own_compiles, _session_compile_memo, _test_own_compiles)\n"
        "def pytest_configure(config):\n    config.addinivalue_line('markers', OWN_COMPILES + ': own')\n")
    body = ("import pytest\nfrom tests._support.compile_memo import active_memo\nKEPT = []  # no id reused\n"
            "def record(name):\n    memo = active_memo()\n    KEPT.append(memo)\n"
            "    with open('memos.txt', 'a') as f:\n        f.write(f'{name} {id(memo) if memo else None}\\n')\n"
            "@pytest.fixture(scope='module')\ndef held():\n    record('fixture')\n"
            "def test_first(held):\n    record(__name__)\n"
            "@pytest.mark.own_compiles\ndef test_second(held):\n    record(__name__)\n"
            "def test_third(held):\n    record(__name__)\n")
    marked = "import pytest\npytestmark = pytest.mark.own_compiles\n"
    for name, head in (("test_a_plain", ""), ("test_b_marked", marked), ("test_c_plain", "")):
        (tmp_path / f"{name}.py").write_text(head + body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS.parent / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "test_a_plain.py", "test_b_marked.py", "test_c_plain.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    seen = [line.split() for line in (tmp_path / "memos.txt").read_text().splitlines()]
    assert [who for who, _ in seen] == (["fixture"] + ["test_a_plain"] * 3 + ["fixture"] + ["test_b_marked"] * 3
                                        + ["fixture"] + ["test_c_plain"] * 3), seen
    memo = seen[0][1]
    assert memo != "None", seen
    assert [m for _, m in seen[:4]] == [memo, memo, "None", memo], seen  # the marked test alone compiles its own
    assert [m for _, m in seen[4:8]] == ["None"] * 4, seen  # a marked module: its fixtures and tests
    assert [m for _, m in seen[8:]] == [memo, memo, "None", memo], seen  # the same memo for the whole run


def test_the_compile_memo_serves_a_program_only_on_its_devices_and_callbacks():
    """The memo's key: a program lowered again is served, the same text on other devices (or with
    another host callback) is compiled; a shared program keeps its own host callback."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tests._support.compile_memo import CompileMemo

    made: list[object] = []
    memo = CompileMemo(lambda lowered: made.append(lowered) or lowered.compile())
    double = lambda x: x * 2  # noqa: E731

    memo(jax.jit(double).lower(jnp.ones(4)))
    memo(jax.jit(lambda x: x * 2).lower(jnp.ones(4)))  # another function, the same program
    assert (len(made), memo.hits) == (1, 1)
    meshes = [Mesh(np.array(jax.devices()[i:i + 2]), ("batch",)) for i in (0, 2)]
    placed = [jax.device_put(jnp.ones(4), NamedSharding(m, PartitionSpec("batch"))) for m in meshes]
    texts = {jax.jit(double).lower(x).as_text() for x in placed}
    assert len(texts) == 1  # the text alone does not tell the devices apart
    for x in placed:
        out = memo(jax.jit(double).lower(x))(x)
        assert {d.id for d in out.sharding.device_set} == {d.id for d in x.sharding.device_set}
    assert len(made) == 3
    one = jax.devices()[1]
    memo(jax.jit(double).lower(jax.device_put(jnp.ones(4), one)))
    assert len(made) == 4  # one device, not the default one

    heard: list[str] = []

    def with_callback(who):
        def program(x):
            jax.debug.callback(lambda v: heard.append(who), x, ordered=False)
            return x + 1
        return program

    for who in ("first", "second"):
        memo(jax.jit(with_callback(who)).lower(jnp.ones(3)))(jnp.ones(3)).block_until_ready()
    jax.effects_barrier()
    assert heard == ["first", "second"] and len(made) == 6


def test_a_tiny_folder_is_written_once_per_run_and_shared_read_only(tmp_path, monkeypatch):
    """tests/_support/shared_folders.py: a builder runs once for the same arguments (defaults filled
    in), each caller gets its own writable copy, ``shared`` hands the stored folder read-only, and a
    stored folder changed behind the store's back fails its next hand-out."""
    import os

    import pytest

    from tests._support import shared_folders

    monkeypatch.setattr(shared_folders, "_root", None)
    monkeypatch.setattr(shared_folders, "_handed", {})
    shared_folders.set_root(tmp_path / "store")
    calls: list[tuple[int, str]] = []

    def build(directory, seed=0, name="w"):
        calls.append((seed, name))
        (directory / "sub").mkdir(parents=True)
        (directory / "sub" / "weights.bin").write_bytes(bytes([seed]) * 8)
        (directory.parent / f".{directory.name}-parts").mkdir()  # a builder's scratch, beside it
        return directory

    build_once = shared_folders.built_once(build)
    a = build_once(tmp_path / "a")
    b = build_once(tmp_path / "b", seed=0)
    c = build_once(tmp_path / "c", 1)
    assert calls == [(0, "w"), (1, "w")]  # seed=0 given or not: one folder
    assert (a / "sub" / "weights.bin").read_bytes() == (b / "sub" / "weights.bin").read_bytes() == bytes(8)
    assert (c / "sub" / "weights.bin").read_bytes() == bytes([1]) * 8
    (a / "sub" / "weights.bin").write_bytes(b"mine")  # a caller's copy is its own
    assert (build_once(tmp_path / "d") / "sub" / "weights.bin").read_bytes() == bytes(8)

    stored = shared_folders.shared(build)
    assert calls == [(0, "w"), (1, "w")] and stored.parent == tmp_path / "store"
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.endswith("-parts")]
    assert not any(os.stat(p).st_mode & 0o222 for p in [stored, *stored.rglob("*")])  # read-only on disk
    weights = stored / "sub" / "weights.bin"
    weights.chmod(0o644)
    weights.write_bytes(b"changed")  # as root may, whatever the mode
    with pytest.raises(AssertionError, match="was changed by a test"):
        shared_folders.shared(build)
    for path in [stored, *stored.rglob("*")]:
        path.chmod(0o755)  # tmp_path's cleanup
