"""SIGTERM drains: the in-flight request completes, new ones are refused, the process exits 0."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server.fixtures import ServerProcess, wait_status


def test_sigterm_finishes_in_flight_refuses_new_and_exits_0(model_dir: Path) -> None:
    # batch wait 2.5 s: the request sits in the queue long enough to be in flight at SIGTERM
    server = ServerProcess([str(model_dir), "--max-batch-size", "2", "--batch-wait-ms", "2500", "--grace-s", "30"])
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
            deadline = time.monotonic() + 30
            while c.get("/health-check").json()["queue_depth"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            server.terminate()
            deadline = time.monotonic() + 30
            while not (health := c.get("/health-check").json()).get("draining"):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert health["status"] == "BUSY"
            refused = c.post("/predictions", json={"input": {"seed": 5}})
            assert refused.status_code == 503 and "shutting down" in refused.json()["detail"]
            t.join(60)
            response = result["response"]
            assert response.status_code == 200 and response.json()["status"] == "succeeded"
        assert server.proc.wait(60) == 0, "\n".join(server.lines[-30:])
    finally:
        server.kill()
