"""Step progress from inside the one compiled denoising loop.

The loop (``preheat.samplers.denoise_loop``) stays one program. A program compiled with progress
(``Signature.progress``) calls the host after every finished step with ``(call, step, total)``;
``call`` is data (``Plan.progress_id``), so one executable serves every call and each call's
steps reach only the callback registered for it (:func:`reporting`), however many calls share
the executable at once.

Why a static switch: a host callback costs a fixed few hundred microseconds per step on a busy
CPU (``preheat bench sampler`` measures it), more than 1 % of the built-in model's step. A call
without a callback runs the program without it -- unchanged pixels, no cost; a server, which
streams every step, compiles the program with it (``preheat.warm.call_inputs``).

Why ``jax.debug.callback`` unordered: ordered effects are refused under ``shard_map`` on more
than one device; the callback's operand ``tie`` (an element of the new sample) makes it wait
for its step. On several devices every device reports each step: the host keeps the highest
step seen per call, so a callback sees each step once, in order.

Cancelling: :meth:`Reporter.stop` makes the next report raise inside the program, which ends
the call within one step (``Pipeline.run`` raises :class:`~preheat.errors.SamplingStopped`).

A host callback cannot be pickled by ``jax.experimental.serialize_executable``;
``preheat.cache.serialized`` stores this module's callback by name and reattaches it on load.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import jax
import numpy as np

__all__ = ["Progress", "Reporter", "Stop", "reporting", "report_step", "current", "ignore", "host_report", "iter_active"]

Progress = Callable[[int, int], None]
"""``progress(step, total)``: called after step ``step`` (1-based) of ``total`` finished."""

_lock = threading.Lock()
_ids = itertools.count(1)  # 0 is "nobody": a program run without a reporter
_active: dict[int, "Reporter"] = {}
_local = threading.local()


class Stop(Exception):
    """A progress callback raises this to end its call at this step (``SamplingStopped``)."""


class _Stopped(Exception):
    """Raised inside the program by a stopped reporter's next step (ends the call)."""


def ignore(step: int, total: int) -> None:
    """A progress callback that does nothing: compiles (and warms) the program with progress."""


@dataclass
class Reporter:
    """One call's registration: its id (the ``Plan.progress_id`` it runs with) and callback."""

    callback: Progress
    id: int = 0
    step: int = 0  # the highest step reported so far
    stopped: bool = False
    error: Optional[BaseException] = field(default=None, repr=False)  # the callback's own failure

    def stop(self) -> None:
        """End the call at its next step (from any thread)."""
        self.stopped = True

    def deliver(self, step: int, total: int) -> None:
        with _lock:
            if step <= self.step:  # another device's copy of a step already reported
                return
            self.step = step
        if self.stopped:
            raise _Stopped(f"call {self.id} stopped at step {step}/{total}")
        try:
            self.callback(step, total)
        except Stop:
            self.stopped = True
            raise _Stopped(f"call {self.id} stopped at step {step}/{total}") from None
        except Exception as err:  # noqa: BLE001 - a broken callback must not abort the program
            self.error = err


def host_report(call: Any, step: Any, total: Any, tie: Any) -> None:
    """The host side of a step report (what the compiled program calls)."""
    del tie  # only orders the call after its step
    reporter = _active.get(int(np.asarray(call)))
    if reporter is not None:
        reporter.deliver(int(np.asarray(step)), int(np.asarray(total)))


def report_step(call: jax.Array, step: jax.Array, total: jax.Array, tie: jax.Array) -> None:
    """Traced: report that ``step`` of ``total`` finished; ``tie``: a value the step computed."""
    jax.debug.callback(host_report, call, step, total, tie.ravel()[0], ordered=False)


class reporting:
    """``with reporting(callback) as reporter:`` registers ``callback`` for one call on this
    thread (``reporter.id`` goes into the plan); ``None`` registers nothing (``reporter`` is None)."""

    def __init__(self, callback: Optional[Progress]) -> None:
        self.reporter = None if callback is None else Reporter(callback)

    def __enter__(self) -> Optional[Reporter]:
        if self.reporter is not None:
            with _lock:
                self.reporter.id = next(_ids)  # int32 in the plan: 2**31 calls per process
                _active[self.reporter.id] = self.reporter
            _local.reporter = self.reporter
        return self.reporter

    def __exit__(self, *exc: Any) -> None:
        if self.reporter is not None:
            with _lock:
                _active.pop(self.reporter.id, None)
            _local.reporter = None


def current() -> Optional[Reporter]:
    """The reporter of the call running on this thread (None without one)."""
    return getattr(_local, "reporter", None)


def iter_active() -> Iterator[Reporter]:
    """Every registered reporter (tests: nothing leaks past its call)."""
    with _lock:
        return iter(list(_active.values()))
