"""What the JAX and torch compilers share about their entries, written once: where they live, the
fleet store (pulls, pushes on a background thread, waited for at exit), a miss explained, a bad
entry quarantined, an event noted. ``JaxCompiler`` (``preheat.cache.compile``) and
``TorchCompiler`` (``preheat.backends.torch.compile_cache``) add only how a program is compiled,
serialised and loaded.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any

from preheat._version import __version__
from preheat.cache.entries import diff_fields, iter_entries, publish_entry, quarantine
from preheat.cache.root import resolve_root
from preheat.env import CACHE_URL_ENV

__all__ = ["EntryCache", "PUSH_GRACE_S", "nearest_entry"]

log = logging.getLogger("preheat.cache")

# At interpreter exit a compiler with background uploads waits up to this long for them (a server
# waits its own push_grace_s at close, before this).
PUSH_GRACE_S = 30.0


def nearest_entry(kind_dir: Path, fields: dict[str, Any]) -> tuple[str | None, list[str]]:
    """The entry whose key fields differ least from ``fields``, and which fields differ."""
    best: tuple[str | None, list[str]] = (None, [])
    for path in iter_entries(kind_dir):
        try:
            have = json.loads((path / "manifest.json").read_text()).get("fields", {})
        except (OSError, ValueError):
            continue
        diff = diff_fields(have, fields)
        if best[0] is None or len(diff) < len(best[1]):
            best = (path.name, diff)
    return best


class EntryCache:
    """Entries of one kind (``compile/<kind>/<key>/``) under a cache root, shared with a fleet store.

    ``remote``: a RemoteStore, None, or "env" ($PREHEAT_CACHE_URL; only in ``mode="full"``, the one
    mode that reads and writes entries). ``events``: one dict per program (key, layer, timings,
    miss reason, quarantine reason, store result)."""

    runs = True  # its executables run on this machine (a target's are for another: ``compile.compile_described``)

    def __init__(self, kind: str, root: Path | None, mode: str, remote: Any) -> None:
        self.kind = kind
        self.mode = mode
        self.root = root or resolve_root().path
        self.kind_dir = self.root / "compile" / kind
        if isinstance(remote, str) and remote == "env":
            remote = None
            if mode == "full" and os.environ.get(CACHE_URL_ENV, "").strip():  # no store: no import
                from preheat.cache.remote import remote_from_env

                remote = remote_from_env()
        self.remote = remote
        self.events: list[dict[str, Any]] = []
        self.background: Any = None  # BackgroundPushes once defer_pushes() was called

    # ------------------------------------------------------------------ the fleet store

    def defer_pushes(self) -> None:
        """From now on uploads run on a background thread: a compile, a warm-up or a request never
        waits on the store. At interpreter exit the process waits up to ``PUSH_GRACE_S`` for what
        is left; a push cut short leaves no manifest, so no reader ever sees half an entry."""
        if self.remote is not None and self.background is None:
            from preheat.cache.remote.background import BackgroundPushes

            self.background = BackgroundPushes(self.remote)
            _AT_EXIT.add(self)

    def wait_pushes(self, timeout: float | None = None) -> bool:
        """Wait for background uploads (True when none is left); at once without a background."""
        return True if self.background is None else self.background.wait(timeout)

    def push_missing(self) -> None:
        """Upload every local entry the store lacks (one whose push failed, or compiled while the
        store was down or unset); entries the store already holds cost one manifest read each."""
        if self.remote is None or self.mode != "full":
            return
        for path in iter_entries(self.kind_dir):
            if (path / "manifest.json").is_file():
                self._push(path)

    def _push(self, path: Path) -> dict[str, Any]:
        """Share one entry with the fleet (never raises: the entry is already local)."""
        if self.background is not None:
            self.background.submit(self.kind, path)
            return {"remote_push": "queued"}
        start = time.perf_counter()
        self.remote.push(self.kind, path)
        return {"remote_push": self.remote.last, "remote_push_s": time.perf_counter() - start}

    def _pull(self, key: str, record: dict[str, Any]) -> bool:
        """A local miss: fetch the entry from the fleet store, which verifies it and publishes it
        locally with the same atomic rename; False without a store or when it lacks the entry."""
        if self.remote is None:
            return False
        start = time.perf_counter()
        hit = self.remote.fetch(self.kind, key, self.kind_dir)
        record.update(remote=self.remote.last, remote_s=time.perf_counter() - start)
        return bool(hit)

    # ------------------------------------------------------------------ entries

    def _publish(self, key: str, files: dict[str, bytes], fields: dict[str, Any], record: dict[str, Any],
                 extra: dict[str, Any] | None = None) -> None:
        """Write an entry (atomically), share it, and keep the cache under its size cap; ``extra``:
        what this entry's manifest records beyond the compiler's ``manifest_extra``."""
        try:
            _, won = publish_entry(self.kind_dir, key, files, fields, extra={**self.manifest_extra(), **(extra or {})})
            record["store"] = "written" if won else "another process wrote it first"
            if won and self.remote is not None:
                record.update(self._push(self.kind_dir / key))
            from preheat.cache.manage import enforce_size_cap

            enforce_size_cap(self.root, keep={key})
        except OSError as exc:
            log.warning("preheat cache: could not write entry %s: %s", key[:12], exc)
            record["store"] = f"write failed: {exc}"

    def manifest_extra(self) -> dict[str, Any]:
        """What an entry's manifest records beside its key."""
        return {"preheat": __version__}

    def _explain_miss(self, fields: dict[str, Any]) -> str:
        name, diff = nearest_entry(self.kind_dir, fields)
        if name is None:
            return "no entries yet"
        return f"nearest entry {name[:12]} differs in {', '.join(diff[:6])}"

    def _quarantine(self, path: Path, reason: str, record: dict[str, Any]) -> None:
        quarantine(self.root, path, reason)
        record["quarantined"] = reason
        if self.remote is not None and record.get("remote") == "hit":
            self.remote.distrust(self.kind, path.name)  # a pulled entry failed here: our push replaces it
        log.warning("preheat cache: entry %s quarantined (%s); recompiling", path.name[:12], reason)

    def _note(self, record: dict[str, Any], timings: Any) -> None:
        record.update(layer=timings.cache_layer, trace_lower_s=timings.trace_lower_s,
                      compile_or_load_s=timings.compile_s)
        self.events.append(record)


# Both compilers register here (only the torch one did). Known gap: from Python 3.12 the
# interpreter refuses new threads once it finalizes, and a store's bounded calls start one, so a
# push still queued when this runs fails ("can't create new thread at interpreter shutdown")
# instead of finishing; servers (push_grace_s) and `preheat warm` wait with wait_pushes before exit.
_AT_EXIT: "weakref.WeakSet[EntryCache]" = weakref.WeakSet()


@atexit.register
def _wait_for_pushes() -> None:
    for cache in list(_AT_EXIT):
        if cache.background is not None and cache.background.pending:
            log.info("preheat cache: waiting up to %.0f s for %d upload(s) to the shared cache", PUSH_GRACE_S,
                     cache.background.pending)
            cache.wait_pushes(PUSH_GRACE_S)

