"""Run one piece of work per item in threads that start together, and hand back what they raised:
an exception in a thread is lost to pytest unless it is carried to the test's own thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def run_together(work: Callable[[T], None], items: Iterable[T], timeout_s: float) -> list[BaseException]:
    """``work(item)`` for every item, each in its own thread, all released at once by a barrier;
    waits up to ``timeout_s`` per thread and returns every exception raised (an empty list: all
    returned). A thread still running after its wait is an error too, so a hang fails the test."""
    items = list(items)
    start = threading.Barrier(len(items))
    errors: list[BaseException] = []

    def run(item: T) -> None:
        try:
            start.wait(timeout_s)
            work(item)
        except BaseException as exc:  # carried to the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(item,), daemon=True) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    errors += [TimeoutError(f"a thread still ran after {timeout_s} s") for t in threads if t.is_alive()]
    return errors
