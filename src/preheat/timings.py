"""Phase timings of one call, shared by the engine, both compile caches and every surface.

It lives below ``engine`` and ``cache`` (it imports nothing of preheat) so that neither has to
import the other to report what a compile cost. ``process_age_s`` is the clock that the CLI's
report and the benchmarks' children read "process start to first image" from.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["Timings", "LAYER_ORDER", "coldest", "process_age_s", "now_iso"]

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
