"""Abuse and edge cases of `preheat serve`, each against a real server on 127.0.0.1: clients
that go away, drains that drop queued work, slow-loris connections, compiles during traffic,
bodies without a length. Work is held with a GatedPipe or Core.pause, never a time window.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx
import pytest

from preheat.server.core import SHUT_DOWN, Core, CoreConfig
from tests._support.server_fixtures import GatedPipe, ServerProcess, metric, serving, wait_status, wait_until


@pytest.fixture
def held(pipe: Any) -> Iterator[tuple[Core, GatedPipe, Any]]:
    """A server whose engine calls wait at ``gp.gate``; one image per batch."""
    gp = GatedPipe(pipe)
    core = Core(CoreConfig(max_batch_size=1, batch_wait_ms=0), pipe=gp).start()
    assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
    try:
        with serving(core) as srv:
            try:
                yield core, gp, srv
            finally:
                gp.gate.set()
    finally:
        gp.gate.set()
        core.close()


def _send(port: int, method: str, path: str, body: dict) -> socket.socket:
    """A client that sends one request and then just holds the connection (read nothing)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _read_to_close(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout = a hang)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_clients_that_go_away_free_their_queued_slots(held: Any) -> None:
    core, gp, srv = held
    gp.hold()
    running = _send(srv.port, "PUT", "/predictions/gone-running", {"input": {"seed": 1}})
    assert gp.entered.wait(60)  # its batch is in the engine, held at the gate
    gone = [_send(srv.port, "PUT", f"/predictions/gone-{i}", {"input": {"seed": 10 + i, "num_inference_steps": 2}})
            for i in range(4)]
    wait_until(lambda: core.queue_depth == 4, what="four queued predictions")
    for s in (running, *gone):
        s.close()  # the clients are killed
    wait_until(lambda: all(core.get(f"gone-{i}").status == "canceled" for i in range(4)), timeout=30,
               what="the abandoned predictions to be canceled")
    assert core.queue_depth == 0  # their slots are free
    assert core.get("gone-running").status == "processing"  # a running batch is not interrupted

    result: dict[str, Any] = {}
    nxt = threading.Thread(target=lambda: result.update(
        r=httpx.post(f"{srv.url}/predictions", json={"input": {"seed": 7}}, timeout=120)))
    nxt.start()
    wait_until(lambda: core.queue_depth == 1, what="the next request to queue")
    gp.gate.set()
    nxt.join(120)
    snap = result["r"].json()
    finished = core.get("gone-running")
    assert snap["status"] == "succeeded" and finished.status == "succeeded"
    # The next request ran right after the running batch: none of the four abandoned ones ran.
    assert snap["metrics"]["batch_id"] == finished.metrics["batch_id"] + 1
    assert core.batcher.stats["batches"] == 2


def test_queued_openai_request_dropped_by_a_drain_gets_503(held: Any) -> None:
    core, gp, srv = held
    gp.hold()
    blocker = httpx.post(f"{srv.url}/predictions", json={"input": {"seed": 1}}, headers={"Prefer": "respond-async"})
    assert blocker.status_code == 202 and gp.entered.wait(60)
    results: dict[str, httpx.Response] = {}

    def call(name: str, path: str, body: dict) -> None:
        results[name] = httpx.post(f"{srv.url}{path}", json=body, timeout=120)

    threads = [threading.Thread(target=call, args=("openai", "/v1/images/generations", {"n": 1, "seed": 2})),
               threading.Thread(target=call, args=("cog", "/predictions", {"input": {"seed": 3}}))]
    for t in threads:
        t.start()
    wait_until(lambda: core.queue_depth == 2, what="both requests to queue")
    core.begin_drain()
    core.close(timeout=0)  # the grace period is over: what the drain does next
    for t in threads:
        t.join(120)
    openai = results["openai"]
    assert openai.status_code == 503, openai.text  # as a new request during the drain gets
    assert openai.json()["error"]["type"] == "server_error" and "shutting down" in openai.json()["error"]["message"]
    cog = results["cog"]  # Cog answers 200 with a failed prediction
    assert cog.status_code == 200 and cog.json()["status"] == "failed" and cog.json()["error"] == SHUT_DOWN


def test_slow_clients_are_cut_off_at_the_read_timeouts(pipe: Any) -> None:
    core = Core(CoreConfig(max_batch_size=1, batch_wait_ms=0), pipe=pipe).start()
    try:
        assert core.wait_setup(600) and core.setup.status == "succeeded"
        with serving(core, header_timeout_s=0.5, body_timeout_s=0.5) as srv:
            loris = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            loris.sendall(b"POST /predictions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
            assert _read_to_close(loris) == b""  # headers never finished: closed, no answer
            loris.close()

            idle = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            assert _read_to_close(idle) == b""  # a connection that never sends anything
            idle.close()

            slow_body = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            slow_body.sendall(b"POST /predictions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 100\r\n\r\n{\"input\"")
            reply = _read_to_close(slow_body)
            slow_body.close()
            assert reply.startswith(b"HTTP/1.1 408 ") and b"connection: close" in reply.lower(), reply[:300]

            r = httpx.post(f"{srv.url}/predictions", json={"input": {"seed": 1}}, timeout=120)  # a prompt client
            assert r.status_code == 200 and r.json()["status"] == "succeeded"
    finally:
        core.close()


def test_mixed_load_compiles_nothing_during_traffic(model_dir: Path, server_env: dict[str, str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import preheat

    # its own in-memory programs: nothing another test compiled counts, except through the warm-up
    # (the session's cache root: the ones ``pipe`` compiled are loaded, not compiled again)
    monkeypatch.setenv("PREHEAT_HOME", server_env["PREHEAT_HOME"])
    fresh = preheat.load(model_dir)
    core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=0, samplers=("dpmpp_2m", "euler")), pipe=fresh).start()
    try:
        assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
        with serving(core) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
            text = c.get("/metrics").text
            warmed = sum(metric(text, "preheat_warmup_programs_total", f'{{cache_layer="{layer}"}}')
                         for layer in ("none", "memory", "aot", "xla"))
            assert warmed == 2 * 2 * 2  # samplers x guidance on/off x buckets 1, 2
            load = [{}, {"guidance_scale": 1}, {"guidance_scale": 0}, {"guidance_scale": 3.5, "num_outputs": 2},
                    {"scheduler": "euler"}, {"scheduler": "euler", "guidance_scale": 1, "num_outputs": 2},
                    {"scheduler": "dpmpp_2m", "num_inference_steps": 7, "guidance_scale": 1.0}]
            for i, inp in enumerate(load):
                r = c.post("/predictions", json={"input": {"seed": i, **inp}})
                assert r.status_code == 200 and r.json()["status"] == "succeeded", (inp, r.text)
            r = c.post("/v1/images/generations", json={"n": 2, "seed": 1})
            assert r.status_code == 200 and len(r.json()["data"]) == 2
            assert metric(c.get("/metrics").text, "preheat_compiles_total", '{phase="traffic"}') == 0
            assert core.batcher.stats["traffic_compiles"] == 0

            refused = c.post("/predictions", json={"input": {"scheduler": "ddim"}})  # not offered: 422, never compiled
            assert refused.status_code == 422
            [error] = refused.json()["detail"]
            assert error["loc"][-1] == "scheduler" and "'dpmpp_2m'" in error["msg"] and "'euler'" in error["msg"]
            props = c.get("/openapi.json").json()["components"]["schemas"]["Input"]["properties"]
            assert props["scheduler"]["anyOf"][0]["enum"] == ["dpmpp_2m", "euler"]
    finally:
        core.close()


def _peak_rss(pid: int) -> Optional[int]:
    """The process's peak RSS (Linux VmHWM), None where the kernel does not report it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss(pid: int) -> None:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def test_a_200mb_chunked_body_is_cut_off_at_the_limit_with_flat_memory(tmp_path: Path) -> None:
    import psutil

    # Set-up fails at once (no model), so no weights or compiles move the RSS; the HTTP layer and
    # its limits run as ever. The server stays up after the failure only when asked to.
    server = ServerProcess([str(tmp_path / "no-such-model"), "--keep-alive-on-failure"])
    sent = {"bytes": 0}
    size = 200 << 20

    def body() -> Iterator[bytes]:  # streamed: the client never holds the body either
        piece = b"x" * (1 << 16)
        yield b'{"input": {"prompt": "'
        for _ in range(size // len(piece)):
            sent["bytes"] += len(piece)
            yield piece
        yield b'"}}'

    try:
        proc = psutil.Process(server.proc.pid)
        with httpx.Client(base_url=server.url, timeout=120) as c:
            wait_status(c, "SETUP_FAILED")
            c.post("/predictions", json={"input": {}})  # warm the request path before measuring
            rss_before = proc.memory_info().rss
            _reset_peak_rss(proc.pid)
            r = c.post("/predictions", content=body(), headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and "request body over" in r.json()["detail"], (r.status_code, r.text[:300])
            rss_after = proc.memory_info().rss
            peak = _peak_rss(proc.pid)
        assert sent["bytes"] < size // 2, "the server kept reading past the limit"
        bound = 48 << 20  # far below the 200 MB sent
        assert rss_after - rss_before < bound, (rss_before, rss_after)
        if peak is not None:
            assert peak - rss_before < bound, (rss_before, peak)
    finally:
        server.kill()
