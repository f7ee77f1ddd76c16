"""Warm-up: the server compiles (or loads) and runs every program a request can reach before it
says READY, so traffic never compiles.

What is reached is the resolved warm declaration (``preheat.warm.signatures``): each offered
sampler (by default only the model's own), guidance on and off (on only when the model has a null
class), every batch bucket, and each variant of the offered inputs (a negative prompt, an image, a
mask; by default all the family declares). The core refuses other samplers and inputs at parse
time. Each program is measured: a metric, and a set-up log line naming the cache layer that served
it and the fleet store's part.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from preheat.server.metrics import CoreMetrics
from preheat.warm import WarmSignature, run_signature

__all__ = ["warm_up"]


def warm_up(pipe: Any, sigs: list[WarmSignature], largest: int, metrics: CoreMetrics,
            say: Callable[[str], None]) -> Optional[float]:
    """Run every signature of ``sigs`` once, in order, saying each (``say``: the set-up log).
    Returns the first seconds-per-step estimate: the slowest engine call among the signatures of
    the ``largest`` bucket, which run one step (None where none is of that bucket)."""
    compiler = pipe.compiler
    first: Optional[float] = None
    for sig in sigs:
        t0 = time.perf_counter()
        events_before = len(getattr(compiler, "events", ()))
        run_signature(pipe, sig)
        sampler, bucket, size = sig.sampler, sig.bucket, sig.size
        layer = pipe.last.cache_layer
        run_s = pipe.last.run_s
        took = time.perf_counter() - t0
        if bucket == largest:  # one step of the largest batch: the first step-time estimate
            first = max(first or 0.0, run_s)
        guided = sig.guided
        metrics.warmup_programs.labels(cache_layer=layer).inc()
        metrics.warmup_seconds.labels(bucket=str(bucket), sampler=sampler, guided=str(guided).lower(),
                                      cache_layer=layer).set(took)
        what = (f" {size[0]}x{size[1]}" if size else "") + "".join(f" +{name}" for name in sig.variant)
        what += f" LoRA rank {sig.lora}" if sig.lora else ""
        remote = _remote_status(getattr(compiler, "events", [])[events_before:])
        say(f"warm-up: {sampler} batch {bucket}{what} guided={guided}: {took:.2f}s (cache: {layer}"
            f"{f', remote: {remote}' if remote else ''})")
    return first


def _remote_status(events: list[dict]) -> Optional[str]:
    """The fleet store's part in one warm-up program (its stages' compile-cache events): "hit"
    when every stage that asked the store was served by it, else the first other answer; None
    when the store was not asked (no store, or a local hit)."""
    answers = [e["remote"] for e in events if e.get("remote")]
    if not answers:
        return None
    return next((a for a in answers if a != "hit"), "hit")
