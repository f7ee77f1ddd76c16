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


def test_the_compile_memo_is_one_per_opting_module_and_absent_elsewhere(tmp_path):
    """``pytest.mark.usefixtures("one_compile_per_program")`` (tests/_support/compile_memo.py, registered
    by tests/conftest.py) gives a module one memo for all its tests, a new one for the next module that
    opts in, and none to a module between them that does not: run in that order, each test writes the
    memo its ``cache="off"`` loads go through."""
    import os
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(
        "from tests._support.compile_memo import one_compile_per_program_fixture  # noqa: F401\n")
    opts_in = 'import pytest\npytestmark = pytest.mark.usefixtures("one_compile_per_program")\n'
    body = ("from tests._support.compile_memo import active_memo\nKEPT = []  # no id reused\n"
            "def record(name):\n    memo = active_memo()\n    KEPT.append(memo)\n"
            "    with open('memos.txt', 'a') as f:\n        f.write(f'{name} {id(memo) if memo else None}\\n')\n"
            "def test_first():\n    record(__name__)\ndef test_second():\n    record(__name__)\n")
    for name, head in (("test_a_opts_in", opts_in), ("test_b_does_not", ""), ("test_c_opts_in", opts_in)):
        (tmp_path / f"{name}.py").write_text(head + body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS.parent / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "test_a_opts_in.py", "test_b_does_not.py", "test_c_opts_in.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    seen = [line.split() for line in (tmp_path / "memos.txt").read_text().splitlines()]
    assert [module for module, _ in seen] == ["test_a_opts_in"] * 2 + ["test_b_does_not"] * 2 + ["test_c_opts_in"] * 2
    a, b, c = (seen[i][1] for i in (0, 2, 4))
    assert a != "None" and seen[1][1] == a, seen  # one memo for the module's tests
    assert b == "None" and seen[3][1] == "None", seen  # left at the module's end: none for the next
    assert c != "None" and seen[5][1] == c and c != a, seen  # a new one for the next module that opts in
