"""A prediction as the server keeps it (Cog's fields, plus what the batcher and the HTTP layer
need: who waits, cancellation, listeners) and the set-up record ``/health-check`` reports."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from preheat.server.inputs import Job
from preheat.timings import now_iso

__all__ = ["Prediction", "BatchRun", "SetupInfo", "Listener", "TERMINAL", "call_listener"]

log = logging.getLogger("preheat.server")

TERMINAL = ("succeeded", "failed", "canceled")
Listener = Callable[[str, dict], None]  # (event, snapshot); event: "start" | "log" (a step) | "completed"


def call_listener(fn: Listener, event: str, snap: dict) -> None:
    """Tell one listener; called from the worker thread, so a listener that raises is logged only."""
    try:
        fn(event, snap)
    except Exception:  # noqa: BLE001 - a broken listener (closed loop, ...) must not stop the worker
        log.debug("listener failed", exc_info=True)


class BatchRun(NamedTuple):
    """One engine call of the batcher, as each of its predictions reports it."""

    batch_id: int
    requests: int
    images: int  # the requests' images (before padding)
    bucket: int  # the compiled batch size it ran in
    sampler: str
    steps: int
    took_s: float  # the batch's predict time (encoding the outputs included)
    run_s: float  # the engine call alone
    compiled: bool  # it compiled (or loaded) a program instead of running one held in memory
    cache_layer: str


@dataclass
class Prediction:
    id: str
    job: Job
    input: dict[str, Any]
    created_at: str = field(default_factory=now_iso)
    status: str = "starting"
    output: Any = None
    error: Optional[str] = None
    logs: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    started_at: Optional[str] = None
    completed_at: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)  # echoed fields: webhook, webhook_events_filter
    enqueued: float = field(default_factory=time.monotonic)
    cancel_requested: bool = False
    respond_async: bool = False  # the client was answered at once (202): nobody's disconnect cancels it
    waiters: int = 0  # clients holding a connection open for the result (see Core.abandon)
    done: threading.Event = field(default_factory=threading.Event)
    _listeners: list[Listener] = field(default_factory=list)

    def snapshot(self) -> dict[str, Any]:
        d = {"id": self.id, "status": self.status, "input": self.input, "output": self.output,
             "error": self.error, "logs": "".join(line + "\n" for line in self.logs),
             "metrics": dict(self.metrics), "created_at": self.created_at, "started_at": self.started_at,
             "completed_at": self.completed_at}
        d.update(self.extra)
        return d

    def record_batch(self, run: BatchRun, offset: int) -> None:
        """The batch this prediction ran in, at image ``offset`` of it: Cog's metrics and a log line."""
        self.metrics.update({"predict_time": run.took_s, "run_time": run.run_s, "batch_id": run.batch_id,
                             "batch_size": run.images, "batch_bucket": run.bucket, "batch_offset": offset,
                             "batch_requests": run.requests, "compiled": run.compiled, "cache_layer": run.cache_layer,
                             "seconds_per_image": run.took_s / run.images})
        self.logs.append(f"batch {run.batch_id}: {run.requests} request(s), {run.images} image(s) in bucket "
                         f"{run.bucket}, {run.sampler} {run.steps} steps, {run.took_s:.3f}s")

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


@dataclass
class SetupInfo:
    started_at: Optional[str] = None
    completed_at: Optional[str] = None
    status: str = "starting"  # starting | succeeded | failed
    logs: list[str] = field(default_factory=list)
    error: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        return {"started_at": self.started_at, "completed_at": self.completed_at, "status": self.status,
                "logs": "".join(line + "\n" for line in self.logs)}
