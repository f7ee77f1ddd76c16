"""One XLA compile per program for a whole test run (per pytest worker): the suite's compile memo.

The suite's tests compile the same tiny programs again and again: every SD folder's VAE decoder,
the encoders of a family's loads, a server's warm-up of the programs the previous module's server
warmed, and the programs a test compiles again on purpose on a copy of a pipeline whose
executables are emptied (``dataclasses.replace(pipe, executables=Executables())``) to watch it trace. A
``cache="off"`` load compiles each through ``preheat.cache.xla_layer.compile_uncached``, and so does
a full-mode miss where the serialisation guard holds (every CPU: ``JaxCompiler.get_or_compile``
compiles with JAX's cache off through the same function, then serialises what it returns).

:class:`CompileMemo` stands in for ``compile_uncached`` and keeps the executables it made by what
decides the executable: the lowered program's text, the devices and shardings of its arguments and
results (the text alone does not name devices: a 2-device program on devices 0-1 and on 2-3 is one
text), their layouts, and the Python functions its host callbacks call (the text names a callback
by an index only). A program traced and lowered again is compiled once. Everything the engine does
and counts is unchanged -- its trace, its lowering, its own ``executables`` entry per signature,
the aot entry it serialises -- only XLA's work on a program it has compiled before is skipped. The
same text is the same program (the weights are its arguments, never constants: ``tests/models``).

``tests/conftest.py`` enters one memo per worker process for the whole session (by default). A
test that counts XLA's own compiles (the ``backend_compile`` events a progress display shows, a
compile's seconds) is marked ``@pytest.mark.own_compiles`` (or a module, in ``pytestmark``): its
compiles and its module's fixtures' go to XLA (:func:`compiles_of_its_own`), and the memo is back
for the next test. ``tests/test_test_layout.py`` checks both."""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Hashable

import pytest

OWN_COMPILES = "own_compiles"
"""The marker of a test (or module) whose compiles must reach XLA, never the memo."""

MAX_PROGRAMS = int(os.environ.get("PREHEAT_TEST_MEMO_PROGRAMS", "128"))
"""Executables the memo keeps, least recently served dropped first: a tiny SD's programs grew a
process by about 20 MB each (RSS, with what compiling them left), so 128 bound a worker's memo to
about 2.5 GB at worst (two workers on a 24 GB machine beside torch's references); a run's programs
that recur (a family's folder at its native size) stay."""


def _xla_layer() -> ModuleType:
    """The module whose ``compile_uncached`` a ``cache="off"`` load calls (imported when first used)."""
    from preheat.cache import xla_layer

    return xla_layer


def _jax_owned(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", "") or ""
    return module == "jax" or module.startswith(("jax.", "jaxlib", "jax_"))


def _callback_functions(obj: Any, depth: int = 0) -> list[Any]:
    """The functions outside JAX that a host callback (JAX's wrapper around the user's callable)
    ends up calling: the wrapper's closures, partials and fields, followed down to them."""
    if depth > 12:
        return []
    if isinstance(obj, functools.partial):
        parts = (obj.func, *obj.args, *obj.keywords.values())
    elif callable(obj) and not _jax_owned(obj):
        return [obj]
    elif _jax_owned(obj):
        parts = tuple(cell.cell_contents for cell in (getattr(obj, "__closure__", None) or ())
                      if _cell_filled(cell))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            parts += tuple(getattr(obj, f.name, None) for f in dataclasses.fields(obj))
        elif hasattr(obj, "__dict__") and not callable(obj):
            parts += tuple(vars(obj).values())
    else:
        return []
    return [leaf for part in parts for leaf in _callback_functions(part, depth + 1)]


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _devices(sharding: Any) -> tuple[int, ...]:
    """The device ids a sharding places on, in its order (a mesh's order decides the program's
    device assignment); () where it names none (an unspecified sharding)."""
    for attr in ("_device_assignment", "device_set"):
        devices = getattr(sharding, attr, None)
        if devices is not None:
            ordered = devices if attr == "_device_assignment" else sorted(devices, key=lambda d: d.id)
            return tuple(int(d.id) for d in ordered)
    return ()


def program_key(lowered: Any) -> Hashable | None:
    """What decides the executable XLA makes of ``lowered``, or None where the memo must not serve
    it (a host callback it cannot tell apart from another)."""
    args = getattr(getattr(lowered, "_lowering", None), "compile_args", None)
    if args is None:
        return None  # not a jit lowering as the engine makes them: compile it
    callbacks: tuple[Any, ...] = ()
    for callback in args.get("host_callbacks") or ():
        found = _callback_functions(callback)
        if not found:
            return None
        callbacks += (tuple(found),)  # the functions themselves: compared by identity, kept alive
    shardings = tuple((repr(s), _devices(s)) for name in ("in_shardings", "out_shardings")
                      for s in (args.get(name) or ()))
    backend = args.get("backend")
    return (lowered.as_text(), getattr(backend, "platform", repr(backend)), args.get("num_devices"), shardings,
            repr(args.get("in_layouts")), repr(args.get("out_layouts")), callbacks)


class CompileMemo:
    """``compile_uncached`` with the executables it made kept by :func:`program_key`; ``compiles``/
    ``hits`` count XLA compiles and the lowerings served a kept executable."""

    def __init__(self, compile_uncached: Any, max_programs: int = MAX_PROGRAMS) -> None:
        self.compile_uncached = compile_uncached
        self._executables: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()  # servers compile on their worker and idle threads
        self._max = max_programs
        self.compiles = 0
        self.hits = 0

    def __call__(self, lowered: Any) -> Any:
        key = program_key(lowered)
        if key is None:
            self.compiles += 1
            return self.compile_uncached(lowered)
        with self._lock:
            hit = self._executables.get(key)
            if hit is not None:
                self._executables.move_to_end(key)
                self.hits += 1
                return hit
        compiled = self.compile_uncached(lowered)  # outside the lock: threads compile side by side
        with self._lock:
            self.compiles += 1
            self._executables[key] = compiled
            while len(self._executables) > self._max:
                self._executables.popitem(last=False)
        return compiled


@contextmanager
def one_compile_per_program() -> Iterator[CompileMemo]:
    """Within the block, ``compile_uncached`` compiles each program once (a run's session)."""
    xla_layer = _xla_layer()
    memo = CompileMemo(xla_layer.compile_uncached)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(xla_layer, "compile_uncached", memo)  # the engine looks it up at each compile
        yield memo


@contextmanager
def compiles_of_its_own() -> Iterator[None]:
    """Within the block, every compile goes to XLA (the memo, where one is active, is set aside)."""
    memo = active_memo()
    if memo is None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_xla_layer(), "compile_uncached", memo.compile_uncached)
        yield


def active_memo() -> CompileMemo | None:
    """The memo compiles go through now, or None where they compile every program."""
    compiled = _xla_layer().compile_uncached
    return compiled if isinstance(compiled, CompileMemo) else None


def wants_own_compiles(node: pytest.Item | pytest.Collector) -> bool:
    """Whether ``node`` (a test, or a module) is marked ``own_compiles``."""
    return node.get_closest_marker(OWN_COMPILES) is not None


@pytest.fixture(scope="session", autouse=True)
def _session_compile_memo() -> Iterator[CompileMemo]:
    """The run's memo (one per worker process): every test's compiles go through it. With
    ``PREHEAT_TEST_MEMO_REPORT=FILE`` each worker appends its counts there at the end (a JSON line)."""
    with one_compile_per_program() as memo:
        yield memo
    report = os.environ.get("PREHEAT_TEST_MEMO_REPORT")
    if report:
        import json

        with open(report, "a") as out:
            out.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "compiles": memo.compiles,
                                  "served": memo.hits, "kept": len(memo._executables)}) + "\n")


@pytest.fixture(scope="module", autouse=True)
def _module_own_compiles(request: pytest.FixtureRequest, _session_compile_memo: CompileMemo) -> Iterator[None]:
    """A module marked ``own_compiles``: its module-scoped fixtures compile for themselves too."""
    if isinstance(request.node, pytest.Module) and wants_own_compiles(request.node):
        with compiles_of_its_own():
            yield
    else:
        yield


@pytest.fixture(autouse=True)
def _test_own_compiles(request: pytest.FixtureRequest, _module_own_compiles: None) -> Iterator[None]:
    """A test marked ``own_compiles``: its compiles are XLA's, counted and timed as in a fresh process."""
    if wants_own_compiles(request.node):
        with compiles_of_its_own():
            yield
    else:
        yield


@pytest.fixture(name="one_compile_per_program")
def one_compile_per_program_fixture(_session_compile_memo: CompileMemo) -> CompileMemo:
    """The run's memo, for a test that reads its counts (every test already compiles through it)."""
    return _session_compile_memo
