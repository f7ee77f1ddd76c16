"""One XLA compile per program in a test module of ``cache="off"`` loads (and full-mode misses).

A module's pipelines of one family compile the same programs: the VAE decoder every SD folder
shares, and the programs a test compiles again on purpose on a copy of a pipeline whose
executables are emptied (``dataclasses.replace(pipe, executables=Executables())``) to watch it trace. With
``cache="off"`` each is a fresh XLA compile (``preheat.cache.xla_layer.compile_uncached``), and so
is a full-mode miss where the serialisation guard holds (every CPU: ``JaxCompiler.get_or_compile``
compiles with JAX's cache off through the same function, then serialises what it returns), as a
module's cold-start and quarantine tests compile the programs its ``cache="off"`` loads did.
:func:`one_compile_per_program` keeps the executables of the module's compiles by their lowered
program's text (and its argument and result shardings): a program traced and lowered again is compiled once. Everything the engine does
and counts is unchanged -- its trace, its lowering, its own ``executables`` entry per signature --
only XLA's work on a program text it has compiled before in this module is skipped. The same text
is the same program (the weights are its arguments, never constants: ``tests/models``).

A test module opts in with one line, ``pytestmark = pytest.mark.usefixtures("one_compile_per_program")``
(the module-scoped fixture below, registered by ``tests/conftest.py``): one memo per module, entered
before the module's first test and left after its last, so a module that does not opt in compiles
every program itself (``tests/test_test_layout.py`` checks both)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import pytest


def _xla_layer() -> ModuleType:
    """The module whose ``compile_uncached`` a ``cache="off"`` load calls (imported when first used)."""
    from preheat.cache import xla_layer

    return xla_layer


class CompileMemo:
    """``compile_uncached`` with the executables it made kept by program text; ``compiles``/``hits``
    count XLA compiles and the lowerings served a kept executable."""

    def __init__(self, compile_uncached: Any) -> None:
        self._compile = compile_uncached
        self._executables: dict[tuple[str, str, str], Any] = {}
        self.compiles = 0
        self.hits = 0

    def __call__(self, lowered: Any) -> Any:
        args = getattr(getattr(lowered, "_lowering", None), "compile_args", {})  # the devices a mesh's program runs on
        key = (lowered.as_text(), repr(args.get("in_shardings")), repr(args.get("out_shardings")))
        hit = self._executables.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        self.compiles += 1
        compiled = self._executables[key] = self._compile(lowered)
        return compiled


@contextmanager
def one_compile_per_program() -> Iterator[CompileMemo]:
    """Within the block, ``cache="off"`` loads compile each program text once (module scope)."""
    xla_layer = _xla_layer()
    memo = CompileMemo(xla_layer.compile_uncached)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(xla_layer, "compile_uncached", memo)  # the engine looks it up at each compile
        yield memo


def active_memo() -> CompileMemo | None:
    """The memo ``cache="off"`` loads go through now, or None where they compile every program."""
    compiled = _xla_layer().compile_uncached
    return compiled if isinstance(compiled, CompileMemo) else None


@pytest.fixture(scope="module", name="one_compile_per_program")
def one_compile_per_program_fixture() -> Iterator[CompileMemo]:
    """A module's opt-in (``pytest.mark.usefixtures("one_compile_per_program")``): its pipelines share
    programs (an SD folder's VAE decoder, the encoders of a family's loads, the programs a
    trace-counting test compiles again on emptied executables), and each is compiled once."""
    with one_compile_per_program() as memo:
        yield memo
