"""Phase timings of one call, shared by the engine, both compile caches and every surface.

It lives below ``engine`` and ``cache`` (it imports nothing of preheat) so that neither has to
import the other to report what a compile cost. ``process_age_s`` is the clock that the CLI's
report and the benchmarks' children read "process start to first image" from.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

__all__ = ["Timings", "LAYER_ORDER", "coldest", "process_age_s", "Phases", "now_s", "now_iso"]

_IMPORTED_AT = time.perf_counter()

# Where an executable came from, coldest first: a call's layer is its coldest stage's.
LAYER_ORDER = ("none", "xla", "mega", "aot", "memory")


def now_iso() -> str:
    """Now, as every timestamp preheat writes for people and other programs (predictions, store
    refs): RFC 3339 in UTC with microseconds and a ``Z``, e.g. ``2026-11-30T19:06:42.123456Z``."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def coldest(a: str, b: str) -> str:
    rank = {name: i for i, name in enumerate(LAYER_ORDER)}
    return a if rank.get(a, 0) <= rank.get(b, 0) else b


@dataclass
class Timings:
    """Phases of the last call, in seconds (the CLI report and bench read these).

    A call may run several compiled stages (text encoding, the denoising loop, VAE decoding);
    the top-level fields sum them, ``cache_layer`` is the coldest, and ``stages`` keeps each.
    """

    trace_lower_s: float = 0.0
    compile_s: float = 0.0  # compile, or load from the cache
    run_s: float = 0.0
    cache_layer: str = "memory"  # where the executable came from: memory | aot | xla | none (| mega: torch)
    stages: dict[str, "Timings"] = field(default_factory=dict)

    def add(self, stage: str, part: "Timings") -> None:
        """Fold one stage's timings into this call's."""
        self.stages[stage] = part
        self.trace_lower_s += part.trace_lower_s
        self.compile_s += part.compile_s
        self.run_s += part.run_s
        self.cache_layer = part.cache_layer if len(self.stages) == 1 else coldest(self.cache_layer, part.cache_layer)

    def to_dict(self) -> dict:
        out = {"trace_lower_s": self.trace_lower_s, "compile_s": self.compile_s, "run_s": self.run_s,
               "cache_layer": self.cache_layer}
        if self.stages:
            out["stages"] = {name: part.to_dict() for name, part in self.stages.items()}
        return out


def process_age_s() -> float:
    """Seconds since this process started (the kernel's clock, so imports are counted)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED_AT


_AGE_OFFSET: float | None = None


def now_s() -> float:
    """Seconds since this process started, on the monotonic clock (``process_age_s`` read once,
    then ``perf_counter``): the time axis of every start-up phase."""
    global _AGE_OFFSET
    if _AGE_OFFSET is None:
        _AGE_OFFSET = process_age_s() - time.perf_counter()
    return time.perf_counter() + _AGE_OFFSET


@dataclass
class Phases:
    """Start-up phases as (start, end) in seconds since process start (``now_s``), from any thread.

    A dotted name is a part of another phase (``executable.pull``, ``first_call.wait``). The
    start-up runs ``import -> model -> (weights || executable) -> first_call``: the executable
    load runs on a background thread while the weights are read, so the critical path takes
    whichever of the two ended last (``critical_path``).
    """

    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, start: float, end: float) -> None:
        with self._lock:
            self.spans[name] = (start, end)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the block as phase ``name`` (recorded even when it raises)."""
        start = now_s()
        try:
            yield
        finally:
            self.add(name, start, now_s())

    def overlap_s(self, a: str, b: str) -> float:
        """How long phases ``a`` and ``b`` ran at the same time (0 when either is missing)."""
        if a not in self.spans or b not in self.spans:
            return 0.0
        (s1, e1), (s2, e2) = self.spans[a], self.spans[b]
        return max(0.0, min(e1, e2) - max(s1, s2))

    def critical_path(self) -> list[str]:
        """The top-level phases the first image waited on, in order."""
        order = [name for name in ("import", "model") if name in self.spans]
        joined = [name for name in ("weights", "executable") if name in self.spans]
        if joined:
            order.append(max(joined, key=lambda name: self.spans[name][1]))
        if "first_call" in self.spans:
            order.append("first_call")
        return order

    def to_dict(self) -> dict:
        with self._lock:
            spans = dict(self.spans)
        path = self.critical_path()
        return {"phases": {name: {"start_s": s, "end_s": e, "seconds": e - s}
                           for name, (s, e) in sorted(spans.items(), key=lambda kv: kv[1][0])},
                "critical_path": path,
                "critical_path_s": spans[path[-1]][1] if path else 0.0,
                "weights_executable_overlap_s": self.overlap_s("weights", "executable")}
