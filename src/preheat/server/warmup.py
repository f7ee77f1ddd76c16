"""Warm-up: the server compiles (or loads) and runs every program a request can reach before it
says READY, so traffic never compiles.

What is reached is the resolved warm declaration (``preheat.warm.signatures``): each offered
sampler (by default only the model's own), guidance on and off (on only when the model has a null
class), every batch bucket, and each variant of the offered inputs (a negative prompt, an image, a
mask; by default all the family declares). The core refuses other samplers and inputs at parse
time. Each program is measured: a metric, and a set-up log line naming the cache layer that served
it and the fleet store's part.

Then one signature of the largest bucket is run twice more, warm, at 1 and 3 steps (the step count
is data: the same executable): what a call costs apart from its steps and what each step adds
(:class:`StepCost`), which ``Retry-After`` reads for a batch of a kind not run yet.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Optional

from preheat.server.metrics import CoreMetrics
from preheat.warm import WarmSignature, call_inputs, run_signature

__all__ = ["StepCost", "step_cost", "warm_up"]


class StepCost(NamedTuple):
    """An engine call's seconds as ``fixed_s + steps * per_step_s``."""

    fixed_s: float  # whatever the steps: encoding, decoding, noise, transfers, the step reports' set-up
    per_step_s: float


def step_cost(pipe: Any, sig: WarmSignature) -> StepCost:
    """``sig``'s call timed warm at 1 and at 3 steps (the engine's run time). Where the machine's
    noise hides the two steps' difference, each step is taken as a third of the 3-step call (the
    safe side: too long, never too short)."""
    def run_s(steps: int) -> float:
        pipe.generate(sig.bucket, **{**call_inputs(pipe, sig), "steps": steps})
        return float(pipe.last.run_s)

    one, three = run_s(1), run_s(3)
    if three <= one:
        return StepCost(0.0, three / 3)
    per_step = (three - one) / 2
    return StepCost(max(0.0, one - per_step), per_step)


def warm_up(pipe: Any, sigs: list[WarmSignature], largest: int, metrics: CoreMetrics,
            say: Callable[[str], None]) -> Optional[StepCost]:
    """Run every signature of ``sigs`` once, in order, saying each (``say``: the set-up log).
    Returns the first estimate of what a call costs (:func:`step_cost` of the slowest signature of
    the ``largest`` bucket; None where none is of that bucket)."""
    compiler = pipe.compiler
    first: Optional[float] = None
    slowest: Optional[WarmSignature] = None
    for sig in sigs:
        t0 = time.perf_counter()
        events_before = len(getattr(compiler, "events", ()))
        run_signature(pipe, sig)
        sampler, bucket, size = sig.sampler, sig.bucket, sig.size
        layer = pipe.last.cache_layer
        run_s = pipe.last.run_s
        took = time.perf_counter() - t0
        if bucket == largest and (first is None or run_s > first):  # the costliest call of the largest batch
            first, slowest = run_s, sig
        guided = sig.guided
        metrics.warmup_programs.labels(cache_layer=layer).inc()
        metrics.warmup_seconds.labels(bucket=str(bucket), sampler=sampler, guided=str(guided).lower(),
                                      cache_layer=layer).set(took)
        what = (f" {size[0]}x{size[1]}" if size else "") + "".join(f" +{name}" for name in sig.variant)
        what += f" LoRA rank {sig.lora}" if sig.lora else ""
        remote = _remote_status(getattr(compiler, "events", [])[events_before:])
        say(f"warm-up: {sampler} batch {bucket}{what} guided={guided}: {took:.2f}s (cache: {layer}"
            f"{f', remote: {remote}' if remote else ''})")
    if slowest is None or first is None:
        return None
    from preheat.errors import PreheatError

    try:
        cost = step_cost(pipe, slowest)
    except PreheatError:  # a sampler that refuses 3 steps: the 1-step call, all of it a step (too long)
        return StepCost(0.0, first)
    return cost


def _remote_status(events: list[dict]) -> Optional[str]:
    """The fleet store's part in one warm-up program (its stages' compile-cache events): "hit"
    when every stage that asked the store was served by it, else the first other answer; None
    when the store was not asked (no store, or a local hit)."""
    answers = [e["remote"] for e in events if e.get("remote")]
    if not answers:
        return None
    return next((a for a in answers if a != "hit"), "hit")
