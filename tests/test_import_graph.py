"""No import cycles in preheat: between its top-level units (the layers below), and between any two
modules at all, packages' own modules included (the second half of this file).

The import graph is read from the source (the AST), not by importing: every ``import`` and
``from ... import`` counts wherever it is written -- at module level, inside a function (the lazy
imports that keep ``import preheat`` light), or under ``TYPE_CHECKING``. ``import preheat`` followed
by ``preheat.load(...)`` counts as importing what ``preheat.load`` resolves to (``preheat._LAZY``).
The package's own ``__init__`` is the facade above everything and is not a unit here. A
``__main__`` module (``python -m preheat.server``) is a program, not library code: it belongs to the
top unit ``__main__`` wherever it sits.

``LAYERS`` is the allowed direction, written down once: a unit may import units of lower tiers
only, never one of its own tier or above. That rules out every cycle between units. Imports that
break the rule today are listed in ``KNOWN_EXCEPTIONS`` with what removes them; an exception that
no longer occurs fails the test, so the list only shrinks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import preheat

SRC = Path(preheat.__file__).resolve().parent

# Lowest tier first. A unit is a top-level module (``engine`` for preheat/engine.py) or package
# (``cache`` for preheat/cache/).
LAYERS: list[tuple[str, ...]] = [
    # leaves: import nothing of preheat
    ("errors", "_version", "timings", "noise", "files", "env", "progress", "terminal", "hard_exit"),
    ("platforms",),  # one description per platform (cpu, gpu, tpu): every platform-dependent choice
    ("sharding", "image_input"),  # the device mesh and data parallelism; reading an image a call passes in
    #   (both import errors only)
    ("cache",),  # the cache root, the compile cache, the shared remote store
    ("store", "models", "samplers"),  # the weights store; model code; pure samplers
    ("lora", "file_configs"),  # LoRA files -> runtime adapters (reads through the store and the models' loader);
    #   the config folder a single checkpoint file is read with (the store pulls what it lacks)
    ("families",),  # per-family loading over the models
    ("denoise",),  # the denoising stage's signature and program (the sampler loop, guidance) over a family's denoiser
    ("model_source",),  # which folder a MODEL argument names (builtin:, random:, a folder, the store)
    ("load_options",),  # what load hands a family's loader beside the folder (second folders, offloading)
    ("engine",),  # Pipeline and preheat.load
    ("backends", "warm"),  # the torch comparison backend; the warm declaration, which drives generate
    ("api", "torch", "settings"),  # preheat.load: dispatches to the engine or the torch backend; preheat.torch.compile;
    #   every serving setting's declaration (its parsers read the warm declaration's)
    ("doctor", "train"),  # surfaces below the command line
    ("server",),
    ("bench", "integrations"),  # bench serve runs the server as a child; Runpod's handler over the server
    ("cli",),  # every click command; nothing below imports click
    ("__main__",),  # python -m preheat, python -m preheat.server
]

# (importing module, imported unit): why the import is there and what removes it.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("preheat.model_source", "bench"): "random:NAME folders are written by bench.random_models (with bench.common's "
    "pixel architecture): moving those builders into a unit below the engine removes it (left for after "
    "issue 55's move of the bench experiments, which touches the same files)",
}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module name (or preheat.<name> for a name imported from a package)
    path: str
    line: int
    names: tuple[str, ...] = ()  # ``from imported import names`` (a name may be a module)

    def units(self) -> tuple[str | None, str | None]:
        return unit_of(self.importer), unit_of(self.imported)


def unit_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "preheat":
        return None
    return "__main__" if parts[-1] == "__main__" else parts[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def lazy_names() -> dict[str, str]:
    """``preheat._LAZY``'s name -> module, read from the facade's source."""
    tree = ast.parse((SRC / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            return {name: module for name, (module, _attr) in ast.literal_eval(node.value).items()}
    raise AssertionError("preheat/__init__.py has no _LAZY table")


def imports_of(path: Path, lazy: dict[str, str]) -> list[Import]:
    """Every preheat import in one file, at any depth."""
    module = module_name(path)
    is_package = path.name == "__init__.py"
    rel = path.relative_to(SRC.parent).as_posix()
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []

    def add(target: str, line: int, names: tuple[str, ...] = ()) -> None:
        found.append(Import(module, target, rel, line, names))

    binds_preheat = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "preheat" or alias.name.startswith("preheat."):
                    add(alias.name, node.lineno)
                    binds_preheat |= alias.asname is None  # `import preheat[.x]` binds the name preheat
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source == "preheat":  # from preheat import errors / load
                for alias in node.names:
                    add(lazy.get(alias.name, f"preheat.{alias.name}"), node.lineno)
            elif source.startswith("preheat."):
                add(source, node.lineno, tuple(alias.name for alias in node.names))
    if binds_preheat:  # import preheat; preheat.load(...)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "preheat":
                add(lazy.get(node.attr, f"preheat.{node.attr}"), node.lineno)
    return found


def all_imports() -> list[Import]:
    lazy = lazy_names()
    return [imp for path in sorted(SRC.rglob("*.py")) if path != SRC / "__init__.py" for imp in imports_of(path, lazy)]


def tier_of() -> dict[str, int]:
    tiers: dict[str, int] = {}
    for i, units in enumerate(LAYERS):
        for unit in units:
            assert unit not in tiers, f"{unit} is listed twice in LAYERS"
            tiers[unit] = i
    return tiers


def violations() -> list[Import]:
    tiers = tier_of()
    out = []
    for imp in all_imports():
        a, b = imp.units()
        if a is None or b is None or a == b:
            continue
        if tiers[b] >= tiers[a]:
            out.append(imp)
    return out


def test_every_unit_has_a_layer():
    units = {module_name(p).split(".")[1] for p in SRC.rglob("*.py") if p != SRC / "__init__.py"}
    missing = sorted(units - set(tier_of()))
    assert not missing, f"add these to LAYERS in {__file__}: {missing}"
    assert not sorted(set(tier_of()) - units), "LAYERS names a unit that no longer exists"


def test_the_graph_sees_module_function_and_facade_imports():
    """The reader finds each kind of import it claims to (else the layering test proves nothing)."""
    found = {(i.importer, i.imported) for i in all_imports()}
    assert ("preheat.engine", "preheat.families.base") in found  # module level
    assert ("preheat.engine", "preheat.cache.compile") in found  # inside a function
    assert ("preheat.cli.cache", "preheat.api") in found  # `import preheat; preheat.load(...)`
    assert ("preheat.store._api", "preheat.cache.remote") in found  # lazy, from a package's __init__


def test_imports_follow_the_layers():
    tiers = tier_of()
    bad = [i for i in violations() if (i.importer, i.units()[1]) not in KNOWN_EXCEPTIONS]
    lines = [f"{i.path}:{i.line}: {i.importer} imports {i.imported} "
             f"({i.units()[0]} is tier {tiers[i.units()[0]]}, {i.units()[1]} tier {tiers[i.units()[1]]})" for i in bad]
    assert not bad, "imports against LAYERS (a lower tier must not import a higher or equal one):\n" + "\n".join(lines)


def test_known_exceptions_still_exist():
    """When an exception is fixed, remove it from KNOWN_EXCEPTIONS so it cannot come back."""
    seen = {(i.importer, i.units()[1]) for i in violations()}
    stale = sorted(set(KNOWN_EXCEPTIONS) - seen)
    assert not stale, f"these no longer break the layering; delete them from KNOWN_EXCEPTIONS: {stale}"


def test_only_the_command_line_imports_click():
    """The library is usable without click: every click import is under preheat/cli/."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "cli":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(SRC.parent)}:{node.lineno}" for n in names if n.split(".")[0] == "click"]
    assert not found, "click imported outside preheat/cli:\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------------
# Modules, not only units: no import cycle between any two modules of src/preheat, packages' own
# modules included. An edge is any import written anywhere in the importer (module level, inside a
# function, under TYPE_CHECKING): a function-level import only delays a cycle to the first call.
# ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to the module
# ``pkg/__init__`` re-exports ``name`` from (else to ``pkg`` itself). Importing ``pkg.mod`` runs
# ``pkg/__init__`` first, but that implied edge is not counted: a package's ``__init__`` that
# re-exports its own modules is the usual layout, not a cycle. ``__main__`` modules are programs
# that nothing imports, and are left out.

# Each cycle that remains, as the sorted set of its modules (one strongly connected component),
# with what removes it. A new cycle fails the test; so does a listed one that is gone (delete it).
ALLOWED_CYCLES: dict[frozenset[str], str] = {}  # none left: a cycle that must stay would be listed here, with why


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))
            if p != SRC / "__init__.py" and p.stem != "__main__"}


def reexports(path: Path, package: str) -> dict[str, str]:
    """A package ``__init__``'s ``name -> module it imports name from`` (one level, module level)."""
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.ImportFrom):
            source = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [node.module or ""]) \
                if node.level else node.module or ""
            for alias in node.names:
                out[alias.asname or alias.name] = source.rstrip(".")
    return out


def module_graph() -> dict[str, set[str]]:
    """importer -> the preheat modules it imports (anywhere in its source)."""
    mods = modules()
    lazy = lazy_names()
    inits = {m: reexports(p, m) for m, p in mods.items() if p.name == "__init__.py"}

    def resolve(target: str) -> str | None:
        for _ in range(8):  # follow re-exports: pkg.name -> the module pkg imports name from
            if target in mods:
                return target
            parent, _, name = target.rpartition(".")
            if parent not in mods:
                return None
            source = inits.get(parent, {}).get(name)
            if source is None or source == parent:  # defined in parent itself
                return parent
            target = f"{source}.{name}"  # a module of source's, or a name defined in source
        raise AssertionError(f"re-exports of {target} go round in circles")

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for imp in imports_of(path, lazy):
            for target in map(resolve, [f"{imp.imported}.{n}" for n in imp.names] or [imp.imported]):
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Every strongly connected component of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(frozenset(component))
    return out


def _describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = sorted(f"{a} -> {b}" for a in component for b in graph[a] if b in component)
    return "{" + ", ".join(sorted(component)) + "}: " + "; ".join(edges)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set(), "g": {"g"}}
    assert sorted(map(sorted, cycles(graph))) == [["a", "b", "c"], ["d", "e"]]


def test_the_module_graph_sees_package_modules_and_reexports():
    graph = module_graph()
    assert "preheat.cache.compile" in graph["preheat.engine"]  # inside a function, inside a package
    assert "preheat.api" in graph["preheat.cli.cache"]  # import preheat; preheat.load
    assert not any(m.endswith("__main__") for m in graph)


def test_no_import_cycle_between_modules():
    graph = module_graph()
    found = cycles(graph)
    new = [c for c in found if c not in ALLOWED_CYCLES]
    assert not new, "import cycles between modules:\n" + "\n".join(_describe(c, graph) for c in new)
    gone = [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert not gone, f"these cycles are gone; delete them from ALLOWED_CYCLES: {gone}"
