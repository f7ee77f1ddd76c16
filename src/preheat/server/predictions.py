"""A prediction as the server keeps it (Cog's fields, plus what the batcher and the HTTP layer
need: who waits, cancellation, listeners) and the set-up record ``/health-check`` reports."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from preheat.server.inputs import Job
from preheat.timings import now_iso

__all__ = ["Prediction", "SetupInfo", "Listener", "TERMINAL"]

TERMINAL = ("succeeded", "failed", "canceled")
Listener = Callable[[str, dict], None]  # (event, snapshot); event: "start" | "log" (a step) | "completed"


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
