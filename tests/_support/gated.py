"""Stores whose chosen operations wait on a gate: a test holds a reader or a writer at an exact
point instead of hoping a timing window opens."""

from __future__ import annotations

import threading
from pathlib import Path

from preheat.cache.remote import LocalDirStore


class Gated:
    """A store mix-in whose held operations wait for ``gate``; ``entered`` says one got that far."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def hold(self) -> None:
        self.entered.set()
        assert self.gate.wait(300), "the test never opened the gate"


class GatedStore(Gated, LocalDirStore):
    """A shared folder whose writes (manifests, payloads) wait for ``gate``."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, trust=True, timeout=120)

    def _put_bytes(self, data: bytes, rel: str) -> None:
        self.hold()
        super()._put_bytes(data, rel)
