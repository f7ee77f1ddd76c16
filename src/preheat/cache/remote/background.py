"""Uploads off the caller's thread: a server queues its pushes here, so neither warm-up nor a
request ever waits on the store, and its shutdown waits for the queue with a bound."""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from typing import Any, Optional

from preheat.cache.remote.policy import log

__all__ = ["BackgroundPushes"]


class BackgroundPushes:
    """One uploader thread (started on the first push) over ``store.push``; FIFO, each entry once
    while it is queued or running. ``results`` holds ``(key, what push did)`` in the order they ran."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.results: list[tuple[str, str]] = []
        self._queue: deque[tuple[str, Path]] = deque()
        self._busy_with: set[tuple[str, Path]] = set()  # queued or running: submitted again = no-op
        self._cond = threading.Condition()
        self._busy = 0  # queued + running
        self._thread: Optional[threading.Thread] = None

    @property
    def pending(self) -> int:
        """Pushes queued or running."""
        with self._cond:
            return self._busy

    def submit(self, kind: str, entry_dir: Path) -> None:
        with self._cond:
            item = (kind, Path(entry_dir))
            if item in self._busy_with:
                return
            self._queue.append(item)
            self._busy_with.add(item)
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="preheat-push", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until every queued push ran; False when ``timeout`` passed first (the rest is
        abandoned with the process: a push without its manifest is invisible to readers)."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._busy == 0, timeout)
        if not done:
            log.warning("preheat cache: %d upload(s) to %s did not finish in %.0f s; leaving them", self.pending,
                        self.store.url, timeout or 0.0)
        return done

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                kind, entry_dir = self._queue.popleft()
            try:
                self.store.push(kind, entry_dir)  # never raises for store trouble
                outcome = self.store.last
            except Exception as exc:  # noqa: BLE001 - a bad entry must not stop the uploader
                outcome = f"failed: {type(exc).__name__}: {exc}"
            with self._cond:
                self.results.append((entry_dir.name, outcome))
                self._busy_with.discard((kind, entry_dir))
                self._busy -= 1
                self._cond.notify_all()
