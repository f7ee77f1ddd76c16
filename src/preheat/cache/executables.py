"""A pipeline's executables in memory, by signature: the compile cache's first layer ("memory").

One owner, so that who changes what is visible: the engine ``put``s what it compiles or loads and
``drop``s one that failed its first run (``Pipeline.compiled_stage``); a server's idle retune (``preheat.cache.retune``) swaps in
an autotuned executable with ``replace``, only where the served one still is. Nothing else
writes it; tests read it (``len``, ``in``, ``signatures``, ``get``).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Executables"]


class Executables:
    """Each signature's compiled executable (a signature selects one program of one stage)."""

    def __init__(self) -> None:
        self._by_sig: dict[Any, Any] = {}
        self._lock = threading.Lock()  # the retune's compare-and-swap runs beside a call's put

    def get(self, sig: Any) -> Any | None:
        """The executable of ``sig``, or None: not compiled or loaded in this process yet."""
        return self._by_sig.get(sig)

    def put(self, sig: Any, executable: Any) -> None:
        """Hold ``executable`` for ``sig`` (compiled, or loaded from the cache)."""
        with self._lock:
            self._by_sig[sig] = executable

    def drop(self, sig: Any) -> None:
        """Forget ``sig``'s executable (a cached one that failed its first run is compiled afresh)."""
        with self._lock:
            self._by_sig.pop(sig, None)

    def replace(self, sig: Any, old: Any, new: Any) -> bool:
        """``new`` for ``sig`` if it still holds ``old`` (a retune never undoes a newer put); whether it did."""
        with self._lock:
            if self._by_sig.get(sig) is not old:
                return False
            self._by_sig[sig] = new
            return True

    def signatures(self) -> list[Any]:
        """The signatures held, in the order they were first put."""
        return list(self._by_sig)

    def __len__(self) -> int:
        return len(self._by_sig)

    def __contains__(self, sig: Any) -> bool:
        return sig in self._by_sig
