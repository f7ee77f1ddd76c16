"""Tiny model folders written once per test run and shared: a builder's folder is the same for
the same arguments, so it is written (through torch and diffusers, a second or more each) once.

``built_once(builder)`` wraps a builder ``builder(directory, *args, **kwargs) -> Path``: the
first call with some arguments writes the folder into the run's store (a directory beside the
workers' temporary roots, so both ``pytest -n 2`` workers find it; a lock lets one write while the
other waits), and every call copies it to ``directory`` -- the caller's own copy, as before, which
a test may change. ``shared(builder, *args, **kwargs)`` hands the stored folder itself, read-only:
for fixtures that only read (load, serve, hash). Its files and folders are made read-only on disk
(a non-root writer fails with PermissionError), and each hand-out checks that nothing in it changed
since it was written (root writes through file modes: the check names the folder and the file).

Outside a pytest session (a child process that imports a builder), builders write as they always
did. The key is the builder's module and name and its arguments' ``repr``: a builder must be
deterministic in them (each seeds torch itself)."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import inspect
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Callable

_root: Path | None = None  # the run's store (set_root), None outside a session
_handed: dict[Path, dict[str, tuple[int, int]]] = {}  # a stored folder: its files' (size, mtime_ns)


def set_root(root: Path | None) -> None:
    """The run's store (``tests/conftest.py``, at session start); None: builders write directly."""
    global _root
    _root = root
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)


def run_root(basetemp: Path) -> Path:
    """The store of this run: beside the workers' roots under xdist (``popen-gw0``, ...), else in the run's."""
    return (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "shared-folders"


def _key(builder: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The builder and its arguments as it sees them (defaults filled in: ``seed=0`` given or not is one folder)."""
    bound = inspect.signature(builder).bind(None, *args, **kwargs)
    bound.apply_defaults()
    named = list(bound.arguments.items())[1:]  # less the directory
    text = repr((builder.__module__, builder.__qualname__, named))
    return f"{builder.__name__}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            st = path.stat()
            out[str(path.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return out


def _read_only(folder: Path) -> None:
    for path in [*folder.rglob("*"), folder]:
        mode = path.stat().st_mode
        path.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _writable(folder: Path) -> None:
    for path in [folder, *folder.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)


def _stored(builder: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Path | None:
    """The stored folder for these arguments (written now if absent), or None outside a session."""
    if _root is None:
        return None
    folder = _root / _key(builder, args, kwargs)
    if folder not in _handed:
        with open(_root / f"{folder.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker may be writing it
            if not folder.is_dir():
                partial = _root / f".{folder.name}.{os.getpid()}"
                shutil.rmtree(partial, ignore_errors=True)
                built = builder(partial, *args, **kwargs)
                if Path(built) != partial:
                    raise ValueError(f"{builder.__qualname__} wrote {built}, not the folder it was given")
                for leftover in partial.parent.glob(f".{partial.name}-*"):  # a builder's scratch parts
                    shutil.rmtree(leftover, ignore_errors=True)
                _read_only(partial)
                partial.rename(folder)
        _handed[folder] = _files(folder)
    elif _files(folder) != _handed[folder]:
        raise AssertionError(f"the shared tiny folder {folder} was changed by a test since it was written: "
                             "copy it first (tests/_support/shared_folders.py)")
    return folder


def shared(builder: Callable[..., Any], *args: Any, **kwargs: Any) -> Path:
    """The run's folder of ``builder(directory, *args, **kwargs)``, read-only (outside a session: a
    new one in a temporary directory)."""
    builder = getattr(builder, "__wrapped__", builder)
    folder = _stored(builder, args, kwargs)
    if folder is None:
        import tempfile

        return Path(builder(Path(tempfile.mkdtemp(prefix="tiny-")) / "model", *args, **kwargs))
    return folder


def built_once(builder: Callable[..., Any]) -> Callable[..., Path]:
    """``builder`` whose folder is written once per run and copied to each caller's ``directory``."""

    @functools.wraps(builder)
    def copy_of(directory: str | Path, *args: Any, **kwargs: Any) -> Path:
        folder = _stored(builder, args, kwargs)
        if folder is None:
            return Path(builder(directory, *args, **kwargs))
        directory = Path(directory)
        shutil.copytree(folder, directory, dirs_exist_ok=True)
        _writable(directory)  # the caller's copy: its own to change
        return directory

    return copy_of
