"""`preheat serve` end to end: a real uvicorn on 127.0.0.1, a real HTTP client (httpx).

Batching is made deterministic with ``Core.pause``: requests queue up while the batcher is
held, and are released together once the test has seen them all queued.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest

from preheat.server.core import Core, CoreConfig
from preheat.server.images import decode_data_url
from tests._support.numerics import px_diff
from tests._support.server_fixtures import local_webhooks, metric, serving, wait_status, wait_until
from tests._support.webhook_receiver import Receiver

MAX_STEPS = 20


@pytest.fixture(scope="module")
def core(pipe: Any):
    core = Core(CoreConfig(max_batch_size=8, batch_wait_ms=0, max_queue=64, max_steps=MAX_STEPS), pipe=pipe).start()
    assert core.wait_setup(600)
    assert core.setup.status == "succeeded", core.setup.logs
    yield core
    core.close()


@pytest.fixture(scope="module")
def server(core: Core):
    with serving(core, webhooks=local_webhooks()) as s:
        yield s


@pytest.fixture
def client(server: Any):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _images(snap: dict) -> list[np.ndarray]:
    return [decode_data_url(u) for u in snap["output"]]


def _together(core: Core, url: str, bodies: list[dict], path: str = "/predictions") -> list[httpx.Response]:
    """Send ``bodies`` concurrently while the batcher is paused; release it once all are queued,
    so they are batched together whatever the timing."""

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
            tasks = [asyncio.ensure_future(ac.post(path, json=b)) for b in bodies]
            deadline = time.monotonic() + 60
            while core.queue_depth < len(bodies):
                assert time.monotonic() < deadline, "the requests never all reached the queue"
                await asyncio.sleep(0.01)
            core.resume()
            return await asyncio.gather(*tasks)

    core.pause()
    try:
        return asyncio.run(fire())
    finally:
        core.resume()


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
    assert "warm-up: dpmpp_2m batch 8 guided=True" in body["setup"]["logs"]
    assert "warm-up: dpmpp_2m batch 8 guided=False" in body["setup"]["logs"]
    text = client.get("/metrics").text
    programs = sum(metric(text, "preheat_warmup_programs_total", f'{{cache_layer="{layer}"}}')
                   for layer in ("none", "memory", "aot", "xla"))
    assert programs == 8  # buckets 1, 2, 4, 8 x guidance on/off, for the model's own sampler
    for bucket in (1, 2, 4, 8):
        assert f'bucket="{bucket}"' in text


def test_concurrent_requests_share_batches_and_keep_their_seed_images(core: Core, server: Any, client: httpx.Client,
                                                                      pipe: Any) -> None:
    before = client.get("/metrics").text
    bodies = [{"input": {"seed": 100 + 7 * i, "class_label": i % 10}} for i in range(8)]
    responses = _together(core, server.url, bodies)
    assert [r.status_code for r in responses] == [200] * 8
    snaps = [r.json() for r in responses]
    assert all(s["status"] == "succeeded" and len(s["output"]) == 1 for s in snaps)
    after = client.get("/metrics").text
    batches = metric(after, "preheat_batches_total") - metric(before, "preheat_batches_total")
    assert batches == 1, f"8 queued requests took {batches} engine calls"
    assert len({s["metrics"]["batch_id"] for s in snaps}) == 1
    assert metric(after, "preheat_compiles_total", '{phase="traffic"}') == 0  # buckets never recompile
    _check_batches_exactly(pipe, snaps)
    # Each image is the one its seed gives alone; across batch sizes XLA may round a pixel by 1 level.
    exact = 0
    for s in snaps:
        solo = pipe.generate(1, class_labels=s["input"]["class_label"], seed=s["input"]["seed"])[0]
        diff = int(px_diff(_images(s)[0], solo).max())
        assert diff <= 1
        exact += diff == 0
    print(f"{exact}/8 images bit-identical to a batch of one")


def test_multi_image_requests_use_seed_plus_i_and_are_padded(core: Core, server: Any, client: httpx.Client,
                                                             pipe: Any) -> None:
    before = client.get("/metrics").text
    bodies = [{"input": {"seed": 40, "class_label": 3, "num_outputs": 3}},
              {"input": {"seed": 7, "class_label": 8, "num_outputs": 2}}]
    snaps = [r.json() for r in _together(core, server.url, bodies)]
    assert [len(s["output"]) for s in snaps] == [3, 2]
    _check_batches_exactly(pipe, snaps)
    after = client.get("/metrics").text
    assert len({s["metrics"]["batch_id"] for s in snaps}) == 1  # 5 images -> bucket 8, 3 dummies
    assert snaps[0]["metrics"]["batch_bucket"] == 8
    assert metric(after, "preheat_padded_images_total") - metric(before, "preheat_padded_images_total") == 3
    # What the request gives by itself (bucket 4, one dummy); other batch sizes may round by 1 level.
    alone = pipe.generate(4, class_labels=[3, 3, 3, 0], seed=[40, 41, 42, 0])[:3]
    assert all(int(px_diff(a, b).max()) <= 1 for a, b in zip(_images(snaps[0]), alone))


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


def test_a_sampler_not_offered_is_422_naming_the_offered_ones(client: httpx.Client) -> None:
    r = client.post("/predictions", json={"input": {"scheduler": "euler"}})  # known, but not warmed here
    assert r.status_code == 422
    [error] = r.json()["detail"]
    assert error["loc"][-1] == "scheduler" and "choose one of dpmpp_2m" in error["msg"], error


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'{"input": [1]}', b'{"input": {"guidance_scale": NaN}}',
                                 b'{"input": {"seed": 1' + b"0" * 5000 + b"}}", b'{"input": {}, "webhook": "not a url"}'])
def test_malformed_bodies_are_422_never_5xx(client: httpx.Client, raw: bytes) -> None:
    r = client.post("/predictions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text


def _chunks(size: int, chunk: int = 1 << 16) -> Any:
    """A JSON body of about ``size`` bytes, streamed (httpx sends a generator chunked)."""
    piece = b"x" * chunk
    yield b'{"input": {"prompt": "'
    for _ in range(size // chunk):
        yield piece
    yield b'"}}'


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_body_is_413_in_each_api_shape(client: httpx.Client, chunked: bool) -> None:
    for path in ("/predictions", "/v1/images/generations"):
        body = _chunks(5 << 20) if chunked else b"".join(_chunks(2 << 20))
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 413, (path, r.status_code, r.text[:200])
        if path.startswith("/v1/"):  # OpenAI's error shape
            assert r.json()["error"]["type"] == "invalid_request_error" and "body" in r.json()["error"]["message"]
        else:
            assert "request body over" in r.json()["detail"]
    assert client.get("/health-check").status_code == 200  # and the server is fine


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"])
def test_non_json_content_type_is_415(client: httpx.Client, content_type: str) -> None:
    for path in ("/predictions", "/v1/images/generations"):
        r = client.post(path, content=b'{"input": {}}', headers={"Content-Type": content_type})
        assert r.status_code == 415, (path, r.status_code, r.text)
        message = r.json()["error"]["message"] if path.startswith("/v1/") else r.json()["detail"]
        assert "application/json" in message


def test_json_content_types_are_accepted(client: httpx.Client) -> None:
    for content_type in ("application/json; charset=utf-8", "application/vnd.cog+json"):
        r = client.post("/predictions", content=b'{"input": {"seed": 1, "num_inference_steps": 1}}',
                        headers={"Content-Type": content_type})
        assert r.status_code == 200 and r.json()["status"] == "succeeded", (content_type, r.text)


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


def test_async_prediction_posts_webhooks_to_a_local_receiver(client: httpx.Client) -> None:
    receiver = Receiver()
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
        # One prediction's webhooks go out in order, each awaited: a "start" would have come first.
        assert receiver.bodies == [final]  # only "completed" was asked for
        assert client.get(f"/predictions/{accepted['id']}").json()["status"] == "succeeded"

        r = client.post("/predictions", headers={"Prefer": "respond-async"},
                        json={"input": {"seed": 12}, "webhook": receiver.url})
        assert r.status_code == 202
        # default filter (every event): start, throttled logs (both "processing"), then completed
        events = receiver.wait_for(lambda b: len(b) > 1 and b[-1]["status"] == "succeeded")[1:]
        statuses = [e["status"] for e in events]
        assert statuses[0] == "processing" and statuses[-1] == "succeeded", statuses
        assert set(statuses[1:-1]) <= {"processing"}, statuses
        assert "step" in events[-1]["logs"], events[-1]["logs"]  # the step lines reached the prediction
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
    # Defaults spelled out (the schema's and the model's) ask for the same thing: not a conflict.
    spelled = {"seed": 9, "num_outputs": 1, "output_format": "png", "num_inference_steps": 4, "scheduler": "dpmpp_2m",
               "guidance_scale": 2.0}
    r4 = client.put(f"/predictions/{pid}", json={"input": spelled})
    assert r4.status_code == 200 and r4.json() == r2.json(), r4.text
    assert client.put(f"/predictions/{pid}", json={"input": {"seed": 10}}).status_code == 409
    assert client.put(f"/predictions/{pid}", json={"input": {"seed": 9, "num_inference_steps": 5}}).status_code == 409
    assert client.put("/predictions/other", json={"id": "not-other", "input": {}}).status_code == 422


def test_cancel_a_waiting_prediction(core: Core, client: httpx.Client) -> None:
    core.pause()  # it waits in the queue until resumed
    try:
        r = client.post("/predictions", json={"input": {"seed": 5}}, headers={"Prefer": "respond-async"})
        pid = r.json()["id"]
        assert client.get(f"/predictions/{pid}").json()["status"] == "starting"
        c = client.post(f"/predictions/{pid}/cancel")
        assert c.status_code == 200 and c.json() == {}
    finally:
        core.resume()
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


def test_full_queue_is_409_on_cog_429_on_openai_with_retry_after_from_the_queue(pipe: Any) -> None:
    core = Core(CoreConfig(max_batch_size=1, max_queue=2, max_steps=200, batch_wait_ms=0), pipe=pipe).start()
    try:
        assert core.wait_setup(600) and core.setup.status == "succeeded"
        with serving(core) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
            core.pause()  # nothing runs: the queue stays as the test fills it
            # a known rate and no fixed cost: two queued 100-step batches drain in 25 s
            core.batcher.fixed_s, core.batcher.seconds_per_step = 0.0, 0.125
            async_ = {"Prefer": "respond-async"}
            a = c.post("/predictions", json={"input": {"seed": 1, "num_inference_steps": 100}}, headers=async_)
            b = c.post("/predictions", json={"input": {"seed": 2, "num_inference_steps": 100}}, headers=async_)
            assert a.status_code == b.status_code == 202
            assert c.get("/health-check").json()["status"] == "BUSY"
            full = c.post("/predictions", json={"input": {"seed": 3}})
            assert full.status_code == 409 and full.headers["retry-after"] == "25", (full.status_code, full.headers)
            openai = c.post("/v1/images/generations", json={"n": 1})
            assert openai.status_code == 429 and openai.headers["retry-after"] == "25"
            assert openai.json()["error"]["type"] == "rate_limit_error"
            assert c.post(f"/predictions/{b.json()['id']}/cancel").status_code == 200
            assert c.get("/health-check").json()["status"] == "READY"
            core.resume()
            wait_until(lambda: c.get(f"/predictions/{a.json()['id']}").json()["status"] in ("succeeded", "failed"),
                       what="the queued prediction to finish")
            assert c.get(f"/predictions/{a.json()['id']}").json()["status"] == "succeeded"
            assert c.get(f"/predictions/{b.json()['id']}").json()["status"] == "canceled"
    finally:
        core.resume()
        core.close()


def test_drain_refuses_new_work_with_503_and_runs_what_it_accepted(pipe: Any) -> None:
    core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=0), pipe=pipe).start()
    try:
        assert core.wait_setup(600) and core.setup.status == "succeeded"
        with serving(core) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
            core.pause()
            queued = c.post("/predictions", json={"input": {"seed": 4}}, headers={"Prefer": "respond-async"}).json()
            core.begin_drain()  # what SIGTERM does first
            health = c.get("/health-check").json()
            assert health["status"] == "BUSY" and health["draining"] is True
            refused = c.post("/predictions", json={"input": {"seed": 5}})
            assert refused.status_code == 503 and "shutting down" in refused.json()["detail"]
            openai = c.post("/v1/images/generations", json={"n": 1})
            assert openai.status_code == 503 and openai.json()["error"]["type"] == "server_error"
            core.resume()
            assert core.wait_idle(120)
            assert c.get(f"/predictions/{queued['id']}").json()["status"] == "succeeded"
    finally:
        core.resume()
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
