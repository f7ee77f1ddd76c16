"""Where preheat keeps everything: one cache root, chosen once per process.

The first rule that applies wins:

1. ``$PREHEAT_HOME``                     explicit choice, always honoured (created if missing)
2. ``/runpod-volume/preheat``            Runpod serverless network volume, if present and writable
3. ``/workspace/.cache/preheat``         Runpod pod volume, if present and writable
4. ``$XDG_CACHE_HOME/preheat``           the XDG convention
5. ``~/.cache/preheat``                  the default

The mount points of rules 2 and 3 can be moved for tests with ``PREHEAT_RUNPOD_VOLUME`` and
``PREHEAT_WORKSPACE`` (they default to ``/runpod-volume`` and ``/workspace``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from preheat.errors import CacheError

__all__ = ["CacheRoot", "resolve_root", "persistent_mounts"]


def _runpod_volume() -> Path:
    return Path(os.environ.get("PREHEAT_RUNPOD_VOLUME", "/runpod-volume"))


def _workspace() -> Path:
    return Path(os.environ.get("PREHEAT_WORKSPACE", "/workspace"))


def persistent_mounts() -> tuple[Path, ...]:
    """Mount points that survive a pod restart (Runpod's network and pod volumes)."""
    return (_runpod_volume(), _workspace())


@dataclass(frozen=True)
class CacheRoot:
    path: Path
    reason: str  # one line: which rule chose it and why

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def resolve_root(create: bool = True) -> CacheRoot:
    """Pick the cache root by the rules above; create it unless ``create`` is False."""
    env = os.environ.get("PREHEAT_HOME")
    if env:
        root = CacheRoot(Path(env).expanduser().absolute(), "$PREHEAT_HOME is set")
    elif _writable_dir(_runpod_volume()):
        root = CacheRoot(_runpod_volume() / "preheat", f"{_runpod_volume()} is a writable Runpod network volume")
    elif _writable_dir(_workspace()):
        root = CacheRoot(_workspace() / ".cache" / "preheat", f"{_workspace()} is a writable Runpod pod volume")
    elif os.environ.get("XDG_CACHE_HOME"):
        root = CacheRoot(Path(os.environ["XDG_CACHE_HOME"]).expanduser().absolute() / "preheat", "$XDG_CACHE_HOME is set")
    else:
        root = CacheRoot(Path.home() / ".cache" / "preheat", "default (~/.cache)")
    if create:
        try:
            root.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot create cache root {root.path}: {exc.strerror or exc}") from None
    return root
