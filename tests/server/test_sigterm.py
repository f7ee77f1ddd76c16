"""SIGTERM drains: the in-flight request completes and the process exits 0.

The request is held in the queue by state, not by timing: with a one-hour batch wait it waits
for a batch-mate that never comes, until the drain (no batch-mate can arrive any more) runs it.
Refusing new work during a drain is tested in-process (tests/server/test_server.py).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._support.server_fixtures import ServerProcess, wait_status, wait_until


def test_sigterm_finishes_in_flight_and_exits_0(model_dir: Path, server_env: dict[str, str]) -> None:
    server = ServerProcess([str(model_dir), "--max-batch-size", "2", "--batch-wait-ms", "3600000", "--grace-s", "60"],
                           env=server_env)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            wait_status(c, "READY", timeout=240)
            result: dict[str, Any] = {}

            def in_flight() -> None:
                result["response"] = httpx.post(f"{server.url}/predictions", json={"input": {"seed": 4, "class_label": 1,
                                                                                            "num_inference_steps": 2}},
                                                timeout=120)

            t = threading.Thread(target=in_flight)
            t.start()
            wait_until(lambda: c.get("/health-check").json()["queue_depth"] == 1, what="the request to queue")
        server.terminate()
        t.join(120)
        response = result["response"]
        assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text
        assert server.proc.wait(60) == 0, "\n".join(server.lines[-30:])
        assert any("draining: 1 prediction(s) in flight" in line for line in server.lines), server.lines[-30:]
    finally:
        server.kill()


@pytest.mark.slow
def test_a_second_sigterm_cuts_the_drain_short_with_json_answers_and_exit_1(model_dir: Path,
                                                                           server_env: dict[str, str]) -> None:
    """The probe: a second SIGTERM gave in-flight requests a plain-text 500 and the process
    aborted (134). Now the running prediction fails as the queued ones do (Cog: its JSON with the
    shut-down error; OpenAI: a JSON 503), and the process exits 1 after one log line."""
    import signal

    from preheat.server.core import SHUT_DOWN

    # every request queued by state (a batch-mate is awaited for an hour) before the first signal;
    # the drain then runs the 6 Cog requests as one batch, and the second signal comes while it runs
    server = ServerProcess([str(model_dir), "--max-batch-size", "8", "--batch-wait-ms", "3600000", "--grace-s", "60"],
                           env=server_env)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            wait_status(c, "READY", timeout=240)
            answers: list = []

            def send(i: int) -> None:
                if i % 3 == 2:
                    r = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "1", "seed": i}, timeout=120)
                else:
                    r = httpx.post(f"{server.url}/predictions", json={"input": {
                        "seed": i, "class_label": 1, "num_inference_steps": 200}}, timeout=120)
                answers.append((i % 3 == 2, r))

            # the Cog requests first, so that their batch heads the queue and is the one running
            threads = [threading.Thread(target=send, args=(i,)) for i in range(9)]
            for t in threads:
                if threads.index(t) % 3 != 2:
                    t.start()
            wait_until(lambda: c.get("/health-check").json()["queue_depth"] == 6, what="the Cog requests to queue")
            for t in threads[2::3]:
                t.start()
            wait_until(lambda: c.get("/health-check").json()["queue_depth"] == 9, what="every request to queue")
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: any("draining:" in line for line in server.lines), what="the drain")
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert server.proc.wait(60) == 1, "\n".join(server.lines[-30:])
        assert len(answers) == 9
        in_flight_failed = 0
        for openai, r in answers:
            body = r.json()  # JSON, never a plain-text 500
            if openai:
                assert r.status_code in (200, 503), r.text[:300]
                if r.status_code == 503:
                    assert body["error"]["type"] == "server_error" and "shutting down" in body["error"]["message"]
            else:
                assert r.status_code == 200 and body["status"] in ("succeeded", "failed"), r.text[:300]
                if body["status"] == "failed":
                    assert body["error"] == SHUT_DOWN
                    in_flight_failed += body["started_at"] is not None
        assert in_flight_failed >= 1  # the running batch's predictions, answered as the queued ones
        cut = [line for line in server.lines if "second signal" in line]
        assert len(cut) == 1 and "drain cut short" in cut[0], server.lines[-30:]
    finally:
        server.kill()


def test_a_third_signal_exits_at_once(model_dir: Path, server_env: dict[str, str]) -> None:
    """While the shutdown waits for a request whose body is still arriving (held by state: the
    body timeout is 30 s), the second signal cuts the drain and the third exits 2 at once."""
    import signal
    import socket
    import time

    server = ServerProcess([str(model_dir), "--grace-s", "60"], env=server_env)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            wait_until(lambda: c.get("/health-check").status_code == 200, what="uvicorn to answer")
        slow = socket.create_connection((server.host, server.port), timeout=30)
        slow.sendall(b"POST /predictions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"input\": ")
        for n in (1, 2):
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # each signal handled on its own (pending signals of one kind coalesce)
            assert server.proc.poll() is None, f"exited after signal {n}: " + "\n".join(server.lines[-20:])
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(10) == 2, "\n".join(server.lines[-30:])
        wait_until(lambda: any("third signal: exiting now" in line for line in server.lines), timeout=10,
                   what="the third signal's log line")
        slow.close()
    finally:
        server.kill()


def test_a_signal_during_warm_up_exits_0(tmp_path: Path) -> None:
    """Stopped while a warm-up program compiles (a thread inside XLA): the process ended with a
    segmentation fault (exit 139) or "FATAL: exception not rethrown" (134) at the interpreter's
    finalisation; it now ends after the atexit handlers (``preheat.cli.run``), exit 0.

    The signal comes once the model is loaded, while warm-up compiles its programs (the text
    model's every sampler and bucket, on an empty cache). It used to wait for the first program to
    finish (about 80 s of make test, more than 240 s on a loaded machine); any program's compile
    is the case. No time window: the server has not said "ready" just before it is signalled."""
    server = ServerProcess(["builtin:text-digits"], env={"PREHEAT_HOME": str(tmp_path / "home")})
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            wait_until(lambda: "model loaded in" in c.get("/health-check").json()["setup"]["logs"],
                       what="the model to load", timeout=240)
            logs = c.get("/health-check").json()["setup"]["logs"]
        server.proc.send_signal(signal.SIGINT)
        assert not any("ready in" in line for line in logs), logs  # warm-up (seconds of compiles) still running
        assert server.proc.wait(120) == 0, "\n".join(server.lines[-30:])
        assert not any("FATAL" in line for line in server.lines), server.lines[-30:]
    finally:
        server.kill()
