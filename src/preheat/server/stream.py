"""Cog's streaming predictions: ``POST /predictions`` with ``Accept: text/event-stream``.

Server-sent events, each framed ``event: NAME`` / ``id: N`` / one ``data:`` line per line of
its text / a blank line:

    event      data
    ---------  ---------------------------------------------------------------------------
    start      the prediction (JSON), as it was accepted
    log        one log line, text: ``Using seed: 7``, then ``step k/N`` per finished step
    metric     JSON timings: queue_wait (s), cache_layer, seconds_per_image, predict_time
    output     the output (JSON: the list of data URLs), when it succeeded
    completed  the whole prediction (JSON), exactly as the JSON route returns it

A client that goes away cancels its prediction, running or queued (``Core.abandon``): a batch
whose predictions are all canceled ends at its next step. An ``Accept`` without
``text/event-stream`` (or with q=0) gets the JSON answer.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Optional

from starlette.responses import StreamingResponse

from preheat.server.core import Core, Prediction

__all__ = ["wants_stream", "frame", "stream_prediction", "METRICS"]

METRICS = ("queue_wait", "cache_layer", "seconds_per_image", "predict_time")


def wants_stream(accept: Optional[str]) -> bool:
    """Whether an ``Accept`` header asks for server-sent events (``text/event-stream``, q > 0)."""
    for part in (accept or "").split(","):
        media, *params = (p.strip() for p in part.split(";"))
        if media.lower() != "text/event-stream":
            continue
        q = next((p.split("=", 1)[1] for p in params if p.lower().startswith("q=")), "1")
        try:
            return float(q) > 0
        except ValueError:
            return False
    return False


def frame(event: str, data: str, event_id: int) -> bytes:
    """One server-sent event; a multi-line ``data`` becomes one ``data:`` line per line."""
    lines = "".join(f"data: {line}\n" for line in data.replace("\r\n", "\n").split("\n"))
    return f"event: {event}\nid: {event_id}\n{lines}\n".encode()


def stream_prediction(core: Core, pred: Prediction) -> StreamingResponse:
    """The event stream of ``pred`` (already submitted, or an idempotent retry's existing one)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def listener(event: str, snap: dict) -> None:  # from the worker thread
        loop.call_soon_threadsafe(queue.put_nowait, (event, snap))

    core.watch(pred)
    start = core.snapshot(pred)
    core.subscribe(pred, listener)

    async def events() -> AsyncIterator[bytes]:
        ids = iter(range(1, 1 << 62))
        done = False
        try:
            yield frame("start", json.dumps(start), next(ids))
            sent = 0  # log lines already sent
            while True:
                event, snap = await queue.get()
                lines = snap["logs"].splitlines()
                for line in lines[sent:]:
                    yield frame("log", line, next(ids))
                sent = len(lines)
                if event != "completed":
                    continue
                done = True
                core.unwatch(pred)
                metrics = {k: snap["metrics"][k] for k in METRICS if k in snap["metrics"]}
                yield frame("metric", json.dumps(metrics), next(ids))
                if snap["status"] == "succeeded":
                    yield frame("output", json.dumps(snap["output"]), next(ids))
                yield frame("completed", json.dumps(snap), next(ids))
                return
        finally:
            if not done:  # the client went away (starlette cancels the stream on disconnect)
                core.abandon(pred, running=True)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
