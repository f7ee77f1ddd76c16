"""SIGTERM drains: the in-flight request completes and the process exits 0.

The request is held in the queue by state, not by timing: with a one-hour batch wait it waits
for a batch-mate that never comes, until the drain (no batch-mate can arrive any more) runs it.
Refusing new work during a drain is tested in-process (tests/server/test_server.py).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx

from tests._support.server_fixtures import ServerProcess, wait_status, wait_until


def test_sigterm_finishes_in_flight_and_exits_0(model_dir: Path) -> None:
    server = ServerProcess([str(model_dir), "--max-batch-size", "2", "--batch-wait-ms", "3600000", "--grace-s", "60"])
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
