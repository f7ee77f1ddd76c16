"""What the commands show while they work: rich spinners and bars on stderr (the CLI, downloads).

Why stderr, and only on a terminal: stdout carries what scripts read (``--json``, a snapshot path),
and a log file or a pipe must not fill with redraws. ``--quiet`` turns all of it off too.

- :class:`Phases`: a spinner with the elapsed time that names the phase (``loading model``, then,
  inside a first call, what JAX is doing: tracing, lowering, compiling, running; JAX reports each
  of these as it ends through ``jax.monitoring``, so the label follows the real work without any
  hook in the engine), and a bar over the denoising steps (:meth:`Phases.step`, the call's
  ``progress`` callback).
- :class:`Count`: ``done/total`` with a bar and the time left (``preheat warm``'s signatures).
Downloads draw their own bar (bytes, rate, time left) when :func:`shown`: ``preheat.store._http``
(and huggingface_hub's, for hf://).
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional, TextIO

__all__ = ["shown", "Phases", "Count"]

# JAX's own compile events (jax._src.dispatch): when one ends, the next phase begins
_JAX_NEXT = {
    "/jax/core/compile/jaxpr_trace_duration": "lowering to XLA",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "compiling (XLA)",
    "/jax/core/compile/backend_compile_duration": "running",
}


def shown(quiet: bool = False, stream: Optional[TextIO] = None) -> bool:
    """Whether progress is drawn: not ``--quiet``, and stderr is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return not quiet and stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


class Phases:
    """One spinner line on stderr, ``⠋ <phase> 0:00:03``, while a phase runs (nothing when off)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self._progress: Any = None
        self._task: Any = None
        self._lock = threading.Lock()

    def __enter__(self) -> "Phases":
        if self.on:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                      BarColumn(bar_width=30), TextColumn("{task.fields[count]}"),
                                      console=_console(), transient=True)
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def label(self, text: str) -> None:
        """Rename the running phase (its clock keeps running)."""
        with self._lock:
            if self._progress is not None and self._task is not None:
                self._progress.update(self._task, description=text, refresh=True)  # seen, however short

    def step(self, step: int, total: int) -> None:
        """A progress callback (``pipe(..., progress=phases.step)``): the bar over the steps."""
        with self._lock:
            if self._progress is not None and self._task is not None:
                self._progress.update(self._task, completed=step, total=total, count=f"{step}/{total} steps",
                                      refresh=step in (1, total))  # the rest at rich's own pace

    @contextmanager
    def phase(self, text: str, jax_steps: bool = False) -> Iterator[None]:
        """A phase with its own clock; ``jax_steps``: follow JAX's tracing/lowering/compiling inside it."""
        if self._progress is None:
            yield
            return
        with self._lock:
            self._task = self._progress.add_task(text, total=None, count="")
        listener = None
        if jax_steps:
            import jax.monitoring

            def listener(event: str, duration_s: float, **kwargs: Any) -> None:
                if event in _JAX_NEXT:
                    self.label(f"{text}: {_JAX_NEXT[event]}")

            self.label(f"{text}: tracing")
            jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            yield
        finally:
            if listener is not None:
                import jax.monitoring

                jax.monitoring.unregister_event_duration_listener(listener)
            with self._lock:
                self._progress.remove_task(self._task)
                self._task = None


class Count:
    """``<label> ━━━━━━  2/5 0:00:04 -:--:--``: items done of a known total (nothing when off)."""

    def __init__(self, on: bool, label: str, total: Optional[int] = None) -> None:  # None: not known yet
        self.on, self.label, self.total = on, label, total
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> "Count":
        if self.on:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                      MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                                      console=_console(), transient=False)
            self._task = self._progress.add_task(self.label, total=self.total)
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def update(self, done: int, total: Optional[int] = None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done, **({"total": total} if total is not None else {}))

    def print(self, line: str) -> None:
        """A log line above the bar (or plain on stderr when the bar is off)."""
        if self._progress is not None:
            self._progress.console.print(line, soft_wrap=True, highlight=False, markup=False)
        else:
            print(line, file=sys.stderr)
