"""Deserialising executables at process start, before the model is built (the warm-start floor).

Once the weights read fast, XLA's deserialisation of the executable is what is left on a warm
start's critical path: the prefetch (``JaxCompiler.prefetch``) can only begin once the model is
built, since the keys come from describing the call on it (``Pipeline.describe``). So each start remembers the keys its
prefetch computed, per (model folder, load options): ``<root>/compile/recent/<id>.json``. The
next start with the same id begins deserialising those entries on a thread the moment
``preheat.load`` is called, before any config is read; when the prefetch later asks for a key,
the executable is waiting, and only the pytree wrapping is left (it needs the arguments' trees,
known once the model exists).

A guess is only a guess: an entry is used only when its manifest's key fields equal the fields
the description computed (the same check as a normal load), and for the argument tree it is
given; a key that is never asked for, or whose fields differ, is dropped unused. All of it runs
off the critical path, and any failure here just leaves the normal load to do its work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Any, NamedTuple, Optional

from preheat.cache.entries import LoadingMarker, checked_entry, unrunnable
from preheat.errors import CacheEntryError
from preheat.files import atomic_write_bytes

__all__ = ["startup_id", "remembered", "remember", "EarlyLoads", "Preloaded"]

log = logging.getLogger("preheat.cache")
EXECUTABLE = "executable.bin"


def startup_id(folder: Any, options: dict[str, Any]) -> str:
    """Which start this is: the model folder (resolved) and the load options that shape programs."""
    text = json.dumps({"folder": str(Path(str(folder)).resolve()) if folder is not None else None, **options},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _record(root: Path, sid: str) -> Path:
    return root / "compile" / "recent" / f"{sid}.json"


def remembered(root: Path, sid: str) -> list[str]:
    """The keys the last start with this id prefetched ([] when none, or the record is unreadable)."""
    try:
        keys = json.loads(_record(root, sid).read_text()).get("keys", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [k for k in keys if isinstance(k, str) and k.isalnum()]


def remember(root: Path, sid: str, keys: list[str]) -> None:
    """Record this start's keys for the next one (atomic; bookkeeping only: never raises)."""
    if not keys or remembered(root, sid) == keys:
        return
    try:
        path = _record(root, sid)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps({"keys": keys}).encode())
    except OSError as exc:
        log.debug("preheat cache: could not remember the start's keys (%s)", exc)


class Preloaded(NamedTuple):
    """An executable deserialised ahead of its pytrees (``jax.experimental.serialize_executable``'s
    pieces): finished by ``EarlyLoads.finish`` once the argument and output trees are known."""

    fields: dict[str, Any]  # the entry's key fields, checked against the asking call's
    executable: Any  # the loaded XLA executable
    args_info_flat: list[Any]
    no_kwargs: bool
    entry: Any  # preheat.cache.entries.Entry (hits are recorded when it is used)


class EarlyLoads:
    """Deserialise ``keys``' entries from ``kind_dir`` on a thread, started at once."""

    def __init__(self, kind_dir: Path, keys: list[str], devices: list[Any]):
        self.kind_dir, self.keys, self.devices = kind_dir, list(keys), list(devices)
        self.results: dict[str, Optional[Preloaded]] = {}
        self._done = {key: threading.Event() for key in self.keys}
        self._thread = threading.Thread(target=self._run, name="preheat-early-deserialise", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for key in self.keys:
            try:
                self.results[key] = self._one(key)
            except Exception as exc:  # a guess that fails costs nothing: the normal load handles the entry
                log.debug("preheat cache: early load of %s failed (%s)", key[:12], exc)
                self.results[key] = None
            finally:
                self._done[key].set()

    def _one(self, key: str) -> Optional[Preloaded]:
        from preheat.cache import serialized  # jax's deserialiser (step reports kept), without its trees

        try:
            entry = checked_entry(self.kind_dir, key)
        except CacheEntryError:
            return None  # the normal load quarantines it
        if entry is None or unrunnable(entry.manifest):
            return None  # (a GPU rejects the latter: the normal load quarantines it unloaded)
        payload = entry.file(EXECUTABLE).read_bytes()
        with LoadingMarker(entry.path):
            executable, args_info_flat, no_kwargs = serialized.load_executable(payload, self.devices)
        return Preloaded(entry.manifest.get("fields"), executable, args_info_flat, no_kwargs, entry)

    def take(self, key: str, fields: dict[str, Any], in_tree: Any, out_tree: Any) -> Any:
        """The finished executable for ``key`` when it was guessed, loaded, and is the program
        ``fields`` describe; None otherwise (the caller loads it as usual)."""
        import jax

        done = self._done.get(key)
        if done is None:
            return None
        done.wait()
        pre = self.results.pop(key, None)
        if pre is None or pre.fields != fields or in_tree.num_leaves != len(pre.args_info_flat):
            return None
        try:
            compiled = jax.stages.Compiled(pre.executable, [], in_tree.unflatten(pre.args_info_flat), out_tree,
                                           no_kwargs=pre.no_kwargs)
        except Exception as exc:  # the tree does not fit: the normal load decides
            log.debug("preheat cache: early executable %s unused (%s)", key[:12], exc)
            return None
        pre.entry.record_hit()
        return compiled

    def drop(self) -> None:
        """Release every executable nobody asked for (a wrong guess)."""
        self.results.clear()
