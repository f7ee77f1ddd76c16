"""Cog's streaming predictions (``preheat.server.stream``) and the step progress behind them, end
to end: a real uvicorn on 127.0.0.1 and a real HTTP client (httpx), the tiny model's real loop."""

from __future__ import annotations

import json
import threading
from typing import Any, Iterator

import httpx
import pytest

from preheat.server.core import Core, CoreConfig
from tests._support.server_fixtures import local_webhooks, serving, wait_status, wait_until
from tests._support.webhook_receiver import Receiver

STEPS = 6


class SteppedPipe:
    """The real pipeline; a batch's step callback waits at step 1 until ``release`` (the test's
    moment to disconnect), so what happens at the next step is decided by count, not by time."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self.at_first = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def run(self, request: Any, progress: Any = None) -> Any:
        def held(step: int, total: int) -> None:
            progress(step, total)
            if step == 1:
                self.at_first.set()
                assert self.release.wait(60)

        return self._pipe.run(request, progress=None if progress is None else held)


@pytest.fixture(scope="module")
def stepped(pipe: Any) -> Iterator[tuple[Core, SteppedPipe, Any]]:
    sp = SteppedPipe(pipe)
    core = Core(CoreConfig(max_batch_size=4, batch_wait_ms=0, max_queue=16, max_steps=20), pipe=sp).start()
    assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
    with serving(core, webhooks=local_webhooks()) as server:
        yield core, sp, server
    core.close()


def _events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event, data) of a server-sent event stream, data lines joined by newlines."""
    event, data = None, []
    for line in lines:
        if line == "":
            if event is not None:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            data.append(line[len("data: "):])


def test_a_stream_sends_start_a_log_per_step_metric_output_completed(stepped: Any) -> None:
    core, _, server = stepped
    body = {"input": {"seed": 5, "num_inference_steps": STEPS}}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/predictions", json=body, headers={"Accept": "text/event-stream"}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = list(_events(r.iter_lines()))
        names = [e for e, _ in events]
        assert names[0] == "start" and names[-3:] == ["metric", "output", "completed"]
        assert set(names[1:-3]) == {"log"}
        logs = [d for e, d in events if e == "log"]
        assert logs[0] == "Using seed: 5"
        assert [line for line in logs if line.startswith("step ")] == [f"step {k}/{STEPS}" for k in range(1, STEPS + 1)]
        start, metric = json.loads(events[0][1]), json.loads(events[-3][1])
        completed = json.loads(events[-1][1])
        assert start["id"] == completed["id"] and completed["status"] == "succeeded"
        assert json.loads(events[-2][1]) == completed["output"]
        assert metric["cache_layer"] == "memory" and metric["queue_wait"] >= 0 and metric["seconds_per_image"] > 0
        # completed is the prediction as the JSON routes give it: the same fields, the same pixels
        assert completed == client.get(f"/predictions/{completed['id']}").json()
        plain = client.post("/predictions", json=body).json()
        assert plain.keys() == completed.keys() and plain["output"] == completed["output"]
        assert plain["logs"].count("step ") == STEPS


def test_an_accept_the_server_cannot_honour_gets_json(stepped: Any) -> None:
    _, _, server = stepped
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for accept in ("application/xml", "text/event-stream;q=0", "text/html, */*"):
            r = client.post("/predictions", json={"input": {"seed": 1, "num_inference_steps": 2}},
                            headers={"Accept": accept})
            assert r.status_code == 200 and r.headers["content-type"] == "application/json", accept
            assert r.json()["status"] == "succeeded"


def test_a_stream_whose_client_goes_away_is_canceled_at_the_next_step(stepped: Any) -> None:
    core, sp, server = stepped
    sp.at_first.clear()
    sp.release.clear()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            with client.stream("POST", "/predictions", json={"input": {"seed": 3, "num_inference_steps": 20}},
                               headers={"Accept": "text/event-stream"}) as r:
                for event, data in _events(r.iter_lines()):
                    if event == "start":
                        pid = json.loads(data)["id"]
                    if data == "step 1/20":
                        break  # leave: the connection closes with the stream
        pred = core.get(pid)
        wait_until(lambda: pred.cancel_requested, 30, "the disconnect to cancel the prediction")
    finally:
        sp.release.set()
    wait_until(lambda: pred.terminal, 60, "the canceled prediction to end")
    assert pred.status == "canceled"
    steps = [line for line in pred.logs if line.startswith("step ")]
    assert steps == ["step 1/20", "step 2/20"]  # it ended at the next step, not after 20
    assert core.wait_idle(60) and core.status == "READY"  # its slot is free


def test_webhook_logs_are_throttled_and_the_filter_applies(stepped: Any) -> None:
    core, sp, server = stepped
    receiver = Receiver()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for events_filter in (["logs", "completed"], ["completed"]):
                r = client.post("/predictions", headers={"Prefer": "respond-async"},
                                json={"input": {"seed": 2, "num_inference_steps": 20}, "webhook": receiver.url,
                                      "webhook_events_filter": events_filter})
                assert r.status_code == 202
                wait_until(lambda: any(b["id"] == r.json()["id"] and b["status"] == "succeeded"
                                       for b in receiver.bodies), 60, "the completed webhook")
        with_logs = [b for b in receiver.bodies if b["id"] != receiver.bodies[-1]["id"]]
        # "logs" included: start (with its logs), then throttled logs; 20 steps in well under
        # 20 x 500 ms, so far fewer than one webhook per step reach the receiver
        assert with_logs[-1]["status"] == "succeeded" and with_logs[-1]["logs"].count("step ") == 20
        assert 2 <= len(with_logs) < 1 + 20
        assert [b["status"] for b in receiver.bodies if b["id"] == receiver.bodies[-1]["id"]] == ["succeeded"]
    finally:
        receiver.close()


def test_defunct_when_the_worker_thread_has_died(pipe: Any) -> None:
    class Fatal(BaseException):
        """Not an Exception: a failed batch is caught, this kills the thread."""

    class Dying:
        def __init__(self) -> None:
            self.die = False

        def __getattr__(self, name: str) -> Any:
            return getattr(pipe, name)

        def run(self, request: Any, **kwargs: Any) -> Any:
            if self.die:
                raise Fatal("the device went away")
            return pipe.run(request, **kwargs)

    dying = Dying()
    core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=0), pipe=dying).start()
    try:
        assert core.wait_setup(600)
        with serving(core) as server, httpx.Client(base_url=server.url, timeout=60) as client:
            wait_status(client, "READY")
            dying.die = True
            r = client.post("/predictions", json={"input": {"seed": 1}})
            assert r.json()["status"] == "failed" and "worker thread died" in r.json()["error"]
            health = wait_status(client, "DEFUNCT")
            assert health["error"] == "Fatal: the device went away"
            assert client.post("/predictions", json={"input": {"seed": 1}}).status_code == 503
    finally:
        core.close()
