"""The image size is declared once (``preheat.families.inputs.IMAGE_SIZE``, ``size_specs``), and
every surface asks for it: no module outside ``preheat/families`` names its two inputs.

Read from the source (the AST), as tests/test_import_graph.py reads imports: a string constant that
is exactly ``"width"`` or ``"height"``, or that holds one quoted (the playground's JavaScript, a
template), is a surface comparing the size's inputs by name. Keyword arguments are not counted:
``width=`` there is another API's parameter (rich's console width, a ``str.format`` field, a
diffusers pipeline called directly by ``bench shapes``), never the size's declaration.
"""

from __future__ import annotations

import ast
from pathlib import Path

import preheat

SRC = Path(preheat.__file__).resolve().parent
NAMES = ("width", "height")
QUOTED = tuple(q + name + q for name in NAMES for q in ('"', "'"))


def size_names(source: str) -> list[tuple[int, str]]:
    """(line, the constant) of each string constant in ``source`` that names a side of the size."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and (node.value in NAMES or any(q in node.value for q in QUOTED))]


def test_the_check_finds_a_name_a_constant_and_a_quoted_name() -> None:
    found = size_names('a = values["width"]\nb = "h" + "eight"\nc = \'if (name === "height") {}\'\n'
                       'd = dict(width=1)\ne = "max-width: 1rem"\n')
    assert sorted(line for line, _ in found) == [1, 3]


def test_no_module_outside_families_names_the_size_inputs() -> None:
    offenders = [f"{path.relative_to(SRC)}:{line}: {text[:60]!r}" for path in sorted(SRC.rglob("*.py"))
                 if path.relative_to(SRC).parts[0] != "families"
                 for line, text in size_names(path.read_text())]
    assert not offenders, "ask for families.inputs.IMAGE_SIZE / size_pair instead:\n" + "\n".join(offenders)


def test_the_declaration_is_where_the_names_are() -> None:
    """The test above looks at something: the families' own source does name them."""
    assert size_names((SRC / "families" / "inputs.py").read_text())
