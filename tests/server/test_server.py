"""`preheat serve` end to end: a real uvicorn on 127.0.0.1, a real HTTP client (httpx)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np
import pytest

from preheat.server.core import Core, CoreConfig
from preheat.server.images import decode_data_url
from tests.server.fixtures import metric, serving, wait_status

MAX_STEPS = 20


@pytest.fixture(scope="module")
def core(pipe: Any):
    core = Core(CoreConfig(max_batch_size=8, batch_wait_ms=500, max_queue=64, max_steps=MAX_STEPS), pipe=pipe).start()
    assert core.wait_setup(600)
    assert core.setup.status == "succeeded", core.setup.logs
    yield core
    core.close()


@pytest.fixture(scope="module")
def server(core: Core):
    with serving(core) as s:
        yield s


@pytest.fixture
def client(server: Any):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _images(snap: dict) -> list[np.ndarray]:
    return [decode_data_url(u) for u in snap["output"]]


def _concurrent(url: str, bodies: list[dict], path: str = "/predictions") -> list[httpx.Response]:
    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
            return await asyncio.gather(*[ac.post(path, json=b) for b in bodies])

    return asyncio.run(fire())


def _check_batches_exactly(pipe: Any, snaps: list[dict]) -> None:
    """Rebuild each engine call from the reported batch layout; the server's pixels must be
    bit-identical to pipe.generate on the same padded batch (same bucket => same program)."""
    batches: dict[int, list[dict]] = {}
    for s in snaps:
        batches.setdefault(s["metrics"]["batch_id"], []).append(s)
    for members in batches.values():
        bucket = members[0]["metrics"]["batch_bucket"]
        seeds, labels = [0] * bucket, [0] * bucket
        for s in members:
            off, n = s["metrics"]["batch_offset"], s["input"].get("num_outputs", 1)
            for i in range(n):
                seeds[off + i] = s["input"]["seed"] + i
                labels[off + i] = s["input"]["class_label"]
        ref = pipe.generate(bucket, class_labels=labels, seed=seeds)
        for s in members:
            off = s["metrics"]["batch_offset"]
            for i, img in enumerate(_images(s)):
                assert np.array_equal(img, ref[off + i]), f"batch {s['metrics']['batch_id']} slot {off + i} differs"


def test_health_ready_and_warmup_covers_every_bucket(client: httpx.Client) -> None:
    body = client.get("/health-check").json()
    assert body["status"] == "READY"
    assert body["setup"]["status"] == "succeeded"
    assert body["setup"]["started_at"] and body["setup"]["completed_at"]
    assert "warm-up: dpmpp_2m batch 8" in body["setup"]["logs"]
    text = client.get("/metrics").text
    programs = sum(metric(text, "preheat_warmup_programs_total", f'{{cache_layer="{layer}"}}')
                   for layer in ("none", "memory", "aot", "xla"))
    assert programs == 4  # buckets 1, 2, 4, 8 for the default signature
    for bucket in (1, 2, 4, 8):
        assert f'bucket="{bucket}"' in text


def test_concurrent_requests_share_batches_and_keep_their_seed_images(server: Any, client: httpx.Client,
                                                                      pipe: Any) -> None:
    before = client.get("/metrics").text
    bodies = [{"input": {"seed": 100 + 7 * i, "class_label": i % 10}} for i in range(8)]
    responses = _concurrent(server.url, bodies)
    assert [r.status_code for r in responses] == [200] * 8
    snaps = [r.json() for r in responses]
    assert all(s["status"] == "succeeded" and len(s["output"]) == 1 for s in snaps)
    after = client.get("/metrics").text
    batches = metric(after, "preheat_batches_total") - metric(before, "preheat_batches_total")
    assert 1 <= batches <= 2, f"8 concurrent requests took {batches} engine calls"
    assert len({s["metrics"]["batch_id"] for s in snaps}) == batches
    assert metric(after, "preheat_compiles_total", '{phase="traffic"}') == 0  # buckets never recompile
    _check_batches_exactly(pipe, snaps)
    # Each image is the one its seed gives alone; across batch sizes XLA may round a pixel by 1 level.
    exact = 0
    for s in snaps:
        solo = pipe.generate(1, class_labels=s["input"]["class_label"], seed=s["input"]["seed"])[0]
        diff = int(np.abs(_images(s)[0].astype(int) - solo.astype(int)).max())
        assert diff <= 1
        exact += diff == 0
    print(f"{exact}/8 images bit-identical to a batch of one")


def test_multi_image_requests_use_seed_plus_i_and_are_padded(server: Any, client: httpx.Client, pipe: Any) -> None:
    before = client.get("/metrics").text
    bodies = [{"input": {"seed": 40, "class_label": 3, "num_outputs": 3}},
              {"input": {"seed": 7, "class_label": 8, "num_outputs": 2}}]
    snaps = [r.json() for r in _concurrent(server.url, bodies)]
    assert [len(s["output"]) for s in snaps] == [3, 2]
    _check_batches_exactly(pipe, snaps)
    after = client.get("/metrics").text
    if len({s["metrics"]["batch_id"] for s in snaps}) == 1:  # 5 images -> bucket 8, 3 dummies
        assert snaps[0]["metrics"]["batch_bucket"] == 8
        assert metric(after, "preheat_padded_images_total") - metric(before, "preheat_padded_images_total") == 3
    # What the request gives by itself (bucket 4, one dummy); other batch sizes may round by 1 level.
    alone = pipe.generate(4, class_labels=[3, 3, 3, 0], seed=[40, 41, 42, 0])[:3]
    assert all(int(np.abs(a.astype(int) - b.astype(int)).max()) <= 1 for a, b in zip(_images(snaps[0]), alone))


BAD_INPUTS = [
    ({"num_outputs": 0}, "num_outputs"),
    ({"num_outputs": 9}, "num_outputs"),
    ({"num_outputs": "two"}, "num_outputs"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"num_inference_steps": MAX_STEPS + 1}, "num_inference_steps"),
    ({"num_inference_steps": 2.5}, "num_inference_steps"),
    ({"guidance_scale": -1}, "guidance_scale"),
    ({"guidance_scale": 51}, "guidance_scale"),
    ({"guidance_scale": "lots"}, "guidance_scale"),
    ({"scheduler": "k_lms"}, "scheduler"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**32}, "seed"),
    ({"seed": "x"}, "seed"),
    ({"seed": 2**32 - 1, "num_outputs": 2}, "seed"),
    ({"class_label": 10}, "class_label"),
    ({"class_label": "cat"}, "class_label"),
    ({"class_label": True}, "class_label"),
    ({"prompt": "a cat"}, "prompt"),
    ({"prompt": "3", "class_label": 4}, "prompt"),
    ({"width": 32}, "width"),
    ({"height": 8}, "height"),
    ({"output_format": "gif"}, "output_format"),
    ({"nonsense": 1}, "nonsense"),
]


@pytest.mark.parametrize(("inp", "field"), BAD_INPUTS, ids=[f"{f}={list(i.values())[0]!r}" for i, f in BAD_INPUTS])
def test_bad_input_is_422_naming_the_field(client: httpx.Client, inp: dict, field: str) -> None:
    r = client.post("/predictions", json={"input": inp})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert any(field in e["loc"] for e in detail), detail


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"input": [1]}', b'{"input": {"guidance_scale": NaN}}',
                                 b'{"input": {"seed": 1' + b"0" * 5000 + b"}}", b'{"input": {}, "webhook": "not a url"}'])
def test_malformed_bodies_are_422_never_5xx(client: httpx.Client, raw: bytes) -> None:
    r = client.post("/predictions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text


def test_oversized_body_is_413(client: httpx.Client) -> None:
    r = client.post("/predictions", content=b'{"input": {"prompt": "' + b"x" * (1 << 20) + b'"}}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 413


def test_openai_images_generations(client: httpx.Client, pipe: Any) -> None:
    from PIL import Image

    r = client.post("/v1/images/generations", json={"prompt": "7", "n": 2, "size": "16x16", "seed": 3,
                                                     "model": "any", "response_format": "b64_json"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["created"], int) and len(body["data"]) == 2
    got = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))))[..., None] for d in body["data"]]
    ref = pipe.generate(2, class_labels=7, seed=3)  # alone in the queue: the same batch of 2
    assert all(np.array_equal(g, e) for g, e in zip(got, ref))
    for bad, param in [({"size": "32x32"}, "size"), ({"prompt": "a cat"}, "prompt"), ({"n": 0}, "n"),
                       ({"n": 9}, "n"), ({"response_format": "url"}, "response_format"), ({"seed": -5}, "seed")]:
        r = client.post("/v1/images/generations", json={"prompt": "1", **bad})
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"]["param"] == param, r.json()


class _Receiver:
    """A tiny webhook receiver on 127.0.0.1 recording every JSON body POSTed to it."""

    def __init__(self) -> None:
        bodies: list[dict] = []
        cond = threading.Condition()
        self.bodies, self.cond = bodies, cond

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with cond:
                    bodies.append(data)
                    cond.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout: float = 60) -> list[dict]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.bodies) >= count, timeout), self.bodies
            return list(self.bodies)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_async_prediction_posts_webhooks_to_a_local_receiver(client: httpx.Client) -> None:
    receiver = _Receiver()
    try:
        r = client.post("/predictions", headers={"Prefer": "respond-async"},
                        json={"input": {"seed": 11, "class_label": "2"}, "webhook": receiver.url,
                              "webhook_events_filter": ["completed"]})
        assert r.status_code == 202, r.text
        accepted = r.json()
        assert accepted["status"] in ("starting", "processing") and accepted["output"] is None
        final = receiver.wait(1)[0]
        assert final["id"] == accepted["id"] and final["status"] == "succeeded" and len(final["output"]) == 1
        assert final["output"][0].startswith("data:image/png;base64,")
        time.sleep(0.3)
        assert len(receiver.bodies) == 1  # only "completed" was asked for
        assert client.get(f"/predictions/{accepted['id']}").json()["status"] == "succeeded"

        r = client.post("/predictions", headers={"Prefer": "respond-async"},
                        json={"input": {"seed": 12}, "webhook": receiver.url})
        assert r.status_code == 202
        events = receiver.wait(3)[1:]  # default filter: start (processing) then completed
        assert [e["status"] for e in events] == ["processing", "succeeded"]
    finally:
        receiver.close()


def test_put_is_idempotent(client: httpx.Client) -> None:
    before = metric(client.get("/metrics").text, "preheat_predictions_total", '{status="succeeded"}')
    pid = "idem-put-1"
    r1 = client.put(f"/predictions/{pid}", json={"input": {"seed": 9}}, headers={"Prefer": "respond-async"})
    assert r1.status_code == 202 and r1.json()["id"] == pid
    r2 = client.put(f"/predictions/{pid}", json={"input": {"seed": 9}})  # a retry attaches and waits
    assert r2.status_code == 200 and r2.json()["status"] == "succeeded" and r2.json()["id"] == pid
    r3 = client.put(f"/predictions/{pid}", json={"input": {"seed": 9}})  # after it finished
    assert r3.json() == r2.json()
    after = metric(client.get("/metrics").text, "preheat_predictions_total", '{status="succeeded"}')
    assert after - before == 1  # ran once
    assert client.put(f"/predictions/{pid}", json={"input": {"seed": 10}}).status_code == 409
    assert client.put("/predictions/other", json={"id": "not-other", "input": {}}).status_code == 422


def test_cancel_a_waiting_prediction(client: httpx.Client) -> None:
    r = client.post("/predictions", json={"input": {"seed": 5}}, headers={"Prefer": "respond-async"})
    pid = r.json()["id"]
    c = client.post(f"/predictions/{pid}/cancel")  # it waits 500 ms for batch-mates
    assert c.status_code == 200 and c.json() == {}
    snap = client.get(f"/predictions/{pid}").json()
    assert snap["status"] == "canceled" and snap["output"] is None and snap["completed_at"]
    assert client.post("/predictions/no-such-id/cancel").status_code == 404
    assert client.get("/predictions/no-such-id").status_code == 404


def test_openapi_states_the_limits(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    for path in ("/predictions", "/predictions/{prediction_id}", "/predictions/{prediction_id}/cancel",
                 "/health-check", "/v1/images/generations", "/metrics"):
        assert path in spec["paths"]
    props = spec["components"]["schemas"]["Input"]["properties"]
    assert props["num_outputs"]["maximum"] == 8 and props["num_inference_steps"]["anyOf"][0]["maximum"] == MAX_STEPS


def test_bearer_token_required_except_health_check(core: Core) -> None:
    with serving(core, token="s3cret") as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        for method, path in [("POST", "/predictions"), ("GET", "/metrics"), ("GET", "/openapi.json"),
                             ("POST", "/v1/images/generations"), ("POST", "/predictions/x/cancel")]:
            r = c.request(method, path, json={"input": {}})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, r.status_code)
        assert c.post("/predictions", json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post("/predictions", json={}, headers={"Authorization": "Basic s3cret"}).status_code == 401
        assert c.get("/health-check").status_code == 200
        r = c.post("/predictions", json={"input": {"seed": 1}}, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["status"] == "succeeded"


def test_full_queue_is_429_with_retry_after_and_busy(pipe: Any) -> None:
    core = Core(CoreConfig(max_batch_size=2, max_queue=2, batch_wait_ms=1500), pipe=pipe).start()
    try:
        assert core.wait_setup(600) and core.setup.status == "succeeded"
        with serving(core) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
            async_ = {"Prefer": "respond-async"}
            a = c.post("/predictions", json={"input": {"seed": 1, "num_inference_steps": 2}}, headers=async_)
            b = c.post("/predictions", json={"input": {"seed": 2, "num_inference_steps": 3}}, headers=async_)
            assert a.status_code == b.status_code == 202
            assert c.get("/health-check").json()["status"] == "BUSY"
            full = c.post("/predictions", json={"input": {"seed": 3}})
            assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
            assert c.post("/v1/images/generations", json={"n": 1}).status_code == 429
            assert c.post(f"/predictions/{b.json()['id']}/cancel").status_code == 200
            assert c.get("/health-check").json()["status"] == "READY"
            deadline = time.monotonic() + 60
            while (snap := c.get(f"/predictions/{a.json()['id']}").json())["status"] not in ("succeeded", "failed"):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert snap["status"] == "succeeded"
            assert c.get(f"/predictions/{b.json()['id']}").json()["status"] == "canceled"
    finally:
        core.close()


def test_setup_failed_is_reported_and_predictions_refused(tmp_path: Any) -> None:
    core = Core(CoreConfig(model=str(tmp_path / "no-such-model"))).start()
    try:
        assert core.wait_setup(60)
        with serving(core) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
            body = c.get("/health-check").json()
            assert body["status"] == "SETUP_FAILED"
            assert body["setup"]["status"] == "failed" and body["setup"]["completed_at"]
            assert "does not exist" in body["error"] and "does not exist" in body["setup"]["logs"]
            r = c.post("/predictions", json={"input": {}})
            assert r.status_code == 503 and "set-up failed" in r.json()["detail"]
    finally:
        core.close()


def test_starting_until_warm_up_ends(pipe: Any) -> None:
    gate = threading.Event()

    def slow_loader(config: CoreConfig) -> Any:
        gate.wait(60)
        return pipe

    core = Core(CoreConfig(max_batch_size=1), loader=slow_loader).start()
    try:
        with serving(core) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
            body = c.get("/health-check").json()
            assert body["status"] == "STARTING" and body["setup"]["status"] == "starting"
            r = c.post("/predictions", json={"input": {}})
            assert r.status_code == 503 and "retry-after" in r.headers
            gate.set()
            wait_status(c, "READY")
            assert c.post("/predictions", json={"input": {"seed": 0}}).json()["status"] == "succeeded"
    finally:
        gate.set()
        core.close()
