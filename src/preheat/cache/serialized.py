"""Serialised executables, with the step-progress host callback (``preheat.progress``) kept.

``jax.experimental.serialize_executable`` pickles an executable's host callbacks, and jax's
are closures, which do not pickle; and loading one back never hands its callbacks to XLA. An
executable whose only host callbacks are preheat's step reports is stored with each replaced
by a :class:`Relay` (picklable: it names ``preheat.progress.host_report``), and on load the
relays are given to XLA with the executable, in the same order, so the loaded program reports
its steps as the compiled one did. An executable without host callbacks is stored exactly as
jax stores it. Any other host callback is refused (the entry is not stored).
"""

from __future__ import annotations

import io
from typing import Any, Callable, Sequence

import jax
from jax.experimental.serialize_executable import _JaxPjrtPickler, _JaxPjrtUnpickler
from jax._src.lib import _jax, xla_client as xc

from preheat.progress import host_report

__all__ = ["Relay", "Unpickler", "serialize", "load_executable", "deserialize_and_load"]

_EXEC = "preheat-exec+callbacks"  # a persistent id: the executable and its relays' token flags


class Relay:
    """Stands in for jax's wrapped step-report callback: the same arguments and results."""

    def __init__(self, token: bool) -> None:
        self.token = token  # the callback threads an effect token first (jax's ``_wrapped_callback``)

    def __call__(self, *args: Any) -> tuple:
        if self.token:
            token, *rest = args
            host_report(*rest)
            return (token,)
        host_report(*args)
        return ()

    def __reduce__(self) -> tuple[Callable[..., "Relay"], tuple[bool]]:
        return Relay, (self.token,)


def _reaches(obj: Any, target: Callable[..., Any], depth: int = 0, seen: set[int] | None = None) -> bool:
    """Whether ``target`` is ``obj`` or what ``obj`` closes over / wraps (jax's callback layers)."""
    if obj is target:
        return True
    seen = set() if seen is None else seen
    if depth > 8 or id(obj) in seen or isinstance(obj, type):
        return False
    seen.add(id(obj))
    inner = [cell.cell_contents for cell in getattr(obj, "__closure__", None) or () if _filled(cell)]
    inner += [getattr(obj, name) for name in ("func", "callback_func", "callback", "__wrapped__")
              if getattr(obj, name, None) is not None]
    return any(_reaches(o, target, depth + 1, seen) for o in inner)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def relays_for(callbacks: Sequence[Any]) -> tuple[Relay, ...]:
    """One relay per host callback; ``ValueError`` when one is not preheat's step report."""
    out = []
    for fn in callbacks:
        if not _reaches(fn, host_report):
            raise ValueError(f"a host callback other than preheat's step report ({fn!r}) cannot be stored")
        out.append(Relay("callback_without_token" in getattr(getattr(fn, "__code__", None), "co_freevars", ())))
    return tuple(out)


class _Pickler(_JaxPjrtPickler):
    def __init__(self, file: Any, relays: tuple[Relay, ...]) -> None:
        super().__init__(file)
        self.relays = relays

    def persistent_id(self, obj: Any) -> Any:
        if self.relays and isinstance(obj, xc.LoadedExecutable):
            return (_EXEC, obj.client.serialize_executable(obj), tuple(r.token for r in self.relays))
        return super().persistent_id(obj)


class Unpickler(_JaxPjrtUnpickler):
    """jax's deserialiser, which also hands an executable its relays."""

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == _EXEC:
            return self.backend.deserialize_executable(pid[1], executable_devices=self.execution_devices,
                                                       host_callbacks=[Relay(t) for t in pid[2]])
        return super().persistent_load(pid)


def serialize(compiled: Any) -> bytes:
    """``compiled`` as bytes (jax's format when it has no host callbacks)."""
    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    callbacks = tuple(getattr(unloaded, "host_callbacks", ()) or ())
    if not callbacks:
        from jax.experimental.serialize_executable import serialize as jax_serialize

        return jax_serialize(compiled)[0]
    if isinstance(unloaded.xla_executable, _jax.Executable) and not isinstance(unloaded.xla_executable,
                                                                               xc.LoadedExecutable):
        raise ValueError("a compile-only executable with host callbacks cannot be stored")
    if getattr(unloaded, "mut", None) and unloaded.mut.in_mut or compiled._params.const_args:
        raise ValueError("an executable with mutable array refs or constant arguments cannot be stored")
    relays = relays_for(callbacks)
    args_info_flat, _ = jax.tree_util.tree_flatten(compiled.args_info)
    unloaded.host_callbacks = relays  # pickled as relays; the live executable keeps its own (restored)
    try:
        with io.BytesIO() as file:
            _Pickler(file, relays).dump((unloaded, args_info_flat, compiled._no_kwargs))
            return file.getvalue()
    finally:
        unloaded.host_callbacks = callbacks


def load_executable(payload: bytes, execution_devices: Sequence[Any]) -> tuple[Any, list[Any], bool]:
    """:func:`serialize`'s bytes as a loaded XLA executable, before its pytrees are known:
    ``(executable, args_info_flat, no_kwargs)``. The one place bytes become a program, for the
    normal load and the early one at process start (``preheat.cache.early``) alike."""
    backend = execution_devices[0].client
    unloaded, args_info_flat, no_kwargs = Unpickler(io.BytesIO(payload), backend, execution_devices).load()
    return unloaded.load(), args_info_flat, no_kwargs


def deserialize_and_load(payload: bytes, in_tree: Any, out_tree: Any, execution_devices: Sequence[Any]) -> Any:
    """``jax.experimental.serialize_executable.deserialize_and_load`` for :func:`serialize`'s bytes."""
    executable, args_info_flat, no_kwargs = load_executable(payload, execution_devices)
    return jax.stages.Compiled(executable, [], in_tree.unflatten(args_info_flat), out_tree, no_kwargs=no_kwargs)
