"""LoRAs through the server (issue 15): ``lora_weights`` / ``lora_scale`` on Cog's route, OpenAI's and
Runpod's; requests with different LoRAs of one rank bucket batched together, each image what the
same request gives alone (at the same batch size); the LRU of LoRAs in /metrics; bad LoRA input a
422 with the server still serving; a declared rank bucket warmed, so no compile during traffic.
Real HTTP on 127.0.0.1, a tiny SD 1.x model; the LoRA files are written here in diffusers' key
names from the model's own layer table (their parity with diffusers is tests/families/test_lora.py's)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

import preheat
from preheat.server.core import Core, CoreConfig
from preheat.server.images import decode_data_url
from tests._support.numerics import mean_abs_px, px_diff
from tests._support.sd_fixtures import save_tiny_sd
from tests._support.server_fixtures import metric, runpod_jobs, serving, wait_status, wait_until

TRAFFIC = ("preheat_compiles_total", '{phase="traffic"}')


def _write_lora(pipe, path: Path, rank: int, seed: int, every: int = 3, encoder: bool = False,
                extra: dict | None = None) -> Path:
    """A random LoRA on every ``every``-th UNet layer (and one text-encoder layer), diffusers' names."""
    from safetensors.numpy import save_file

    targets = pipe.lora_runtime.targets
    rng = np.random.default_rng(seed)
    tensors = {}
    parts = [("unet", list(targets.layers["denoiser"].items())[::every])]
    if encoder:
        parts.append(("text_encoder", list(targets.layers["text_encoder"].items())[:2]))
    for prefix, layers in parts:
        for name, (cin, cout) in layers:
            tensors[f"{prefix}.{name}.lora_A.weight"] = (rng.standard_normal((rank, cin)) / np.sqrt(cin)).astype(np.float32)
            tensors[f"{prefix}.{name}.lora_B.weight"] = (0.5 * rng.standard_normal((cout, rank))).astype(np.float32)
    tensors.update(extra or {})
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def sd_pipe(tmp_path_factory):
    return preheat.load(save_tiny_sd(tmp_path_factory.mktemp("lora-server") / "sd1", kind="sd1"), cache="off")


@pytest.fixture(scope="module")
def loras(sd_pipe, tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-files")
    out = {"A": _write_lora(sd_pipe, base / "a.safetensors", 4, 1, encoder=True),
           "B": _write_lora(sd_pipe, base / "b.safetensors", 8, 2, every=2)}
    for name, seed in (("C", 3), ("D", 4), ("E", 5)):
        out[name] = _write_lora(sd_pipe, base / f"{name.lower()}.safetensors", 4, seed)
    cin, cout = next(iter(sd_pipe.lora_runtime.targets.layers["denoiser"].values()))
    out["unknown"] = _write_lora(sd_pipe, base / "unknown.safetensors", 4, 6, extra={
        "unet.no_such_block.to_q.lora_A.weight": np.zeros((4, cin), np.float32),
        "unet.no_such_block.to_q.lora_B.weight": np.zeros((cout, 4), np.float32)})
    out["rank200"] = _write_lora(sd_pipe, base / "rank200.safetensors", 200, 7, every=50)
    data = out["A"].read_bytes()
    (base / "torn.safetensors").write_bytes(data[: len(data) // 2])
    out["torn"] = base / "torn.safetensors"
    return out


@pytest.fixture(scope="module")
def core(sd_pipe, loras):
    # Text-only requests: the server offers no optional input (inputs=()), so it warms the text
    # programs alone, with and without LoRA, not SD 1.x's image, mask and negative-prompt variants.
    core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=0, max_steps=30, guidance=("on",), lora_ranks=(16,),
                           max_loras=2, lora_dir=str(loras["A"].parent), inputs=()), pipe=sd_pipe)
    core.start()
    assert core.wait_setup(900) and core.setup.status == "succeeded", core.setup.logs
    yield core
    core.close()


def _post_all(client, bodies: list[dict]) -> list:
    """POST each body to /predictions at once (one thread each); the responses in order."""
    out: list = [None] * len(bodies)

    def send(i: int) -> None:
        out[i] = client.post("/predictions", json=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def _image(response) -> np.ndarray:
    assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text
    return decode_data_url(response.json()["output"][0])


def test_different_loras_share_a_batch_and_each_image_is_what_it_is_alone(core, loras):
    import httpx

    with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
        wait_status(client, "READY")
        a = {"prompt": "a photo of a cat", "num_inference_steps": 2, "seed": 5, "lora_weights": str(loras["A"]),
             "lora_scale": 0.8}
        b = {"prompt": "a red fox", "num_inference_steps": 2, "seed": 9, "lora_weights": str(loras["B"])}
        results: list = []
        pending = threading.Thread(target=lambda: results.extend(_post_all(client, [{"input": a}, {"input": b}])))
        core.pause()  # both queued before the worker collects a batch
        try:
            pending.start()
            wait_until(lambda: core.queue_depth == 2, what="two queued predictions")
        finally:
            core.resume()
        pending.join(300)
        mixed = [_image(r) for r in results]
        ids = {r.json()["metrics"]["batch_id"] for r in results}
        assert len(ids) == 1 and results[0].json()["metrics"]["batch_requests"] == 2  # one engine call
        # each alone, at the same batch size (2 images of the same request): what it gave in the mixed batch
        for given, got in ((a, mixed[0]), (b, mixed[1])):
            r = client.post("/predictions", json={"input": {**given, "num_outputs": 2}})
            assert px_diff(_image(r), got).max() <= 1
        plain = _image(client.post("/predictions", json={"input": {k: v for k, v in a.items()
                                                                   if not k.startswith("lora")}}))
        assert mean_abs_px(plain, mixed[0]) > 2  # the LoRA mattered
        # OpenAI's route takes the same fields
        r = client.post("/v1/images/generations", json={"prompt": "a photo of a cat", "n": 1, "seed": 5,
                                                         "lora_weights": str(loras["A"]), "lora_scale": 0.8})
        assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
        # rank 4 (with a text-encoder part) and 8, no LoRA: all warmed (--lora-ranks 16): no compile in traffic
        assert metric(client.get("/metrics").text, *TRAFFIC) == 0


def test_the_lru_of_loras_counts_hits_misses_and_evictions(core, loras, sd_pipe):
    """/metrics counts the LRU the pipeline uses now. Other tests here serve the same pipeline from
    Cores of their own, and each Core's set-up holds a fresh LRU of its --max-loras: this one holds
    its core's again (a stale count of a replaced LRU was the CI failure this test caught)."""
    import httpx

    names = ("hits", "misses", "evictions")
    with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
        wait_status(client, "READY")
        sd_pipe.lora_runtime.hold(max_loras=core.config.max_loras)
        text = client.get("/metrics").text
        before = {n: metric(text, f"preheat_lora_cache_{n}_total") for n in names}
        held = metric(text, "preheat_lora_cache_loras")
        assert metric(text, "preheat_lora_cache_max_loras") == 2
        for name in ("C", "D", "C", "E", "D", "E"):  # miss, miss, hit, miss (D out), miss (C out), hit
            r = client.post("/predictions", json={"input": {"prompt": "x", "num_inference_steps": 1, "seed": 1,
                                                            "lora_weights": str(loras[name])}})
            assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
        text = client.get("/metrics").text
        delta = {n: metric(text, f"preheat_lora_cache_{n}_total") - before[n] for n in names}
        # what was held before (other tests' LoRAs) leaves as C and D come in
        assert delta == {"hits": 2, "misses": 4, "evictions": 2 + held}, delta
        assert metric(text, "preheat_lora_cache_loras") == 2
        assert metric(text, *TRAFFIC) == 0


def test_bad_lora_input_is_a_one_line_422_and_the_server_keeps_serving(core, loras, tmp_path):
    import httpx

    base = {"prompt": "x", "num_inference_steps": 1, "seed": 2}
    cases = [
        ({"lora_weights": str(loras["unknown"])}, "match no layer"),
        ({"lora_weights": str(loras["rank200"])}, "buckets: 16, 32, 64, 128"),
        ({"lora_weights": str(loras["torn"])}, "lora_weights"),
        ({"lora_weights": str(loras["A"].parent / "missing.safetensors")}, "does not exist"),
        ({"lora_weights": "missing.safetensors"}, "does not exist"),  # relative to --lora-dir
        ({"lora_weights": str(tmp_path / "elsewhere.safetensors")}, "not under the server's --lora-dir"),
        ({"lora_weights": "../" + loras["A"].parent.name + "x/a.safetensors"}, "not under the server's --lora-dir"),
        ({"lora_weights": "file:///etc/hostname"}, "file:// is not a LoRA source"),
        ({"lora_weights": str(loras["A"]), "lora_scale": 5.0}, "lora_scale"),
        ({"lora_weights": str(loras["A"]), "lora_scale": "strong"}, "lora_scale"),
    ]
    with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
        wait_status(client, "READY")
        for fields, words in cases:
            r = client.post("/predictions", json={"input": {**base, **fields}})
            assert r.status_code == 422, (fields, r.text)
            detail = r.json()["detail"]
            message = " ".join(str(d["loc"]) + d["msg"] for d in detail)
            assert words in message and all("\n" not in d["msg"] for d in detail), (fields, detail)
            assert any("lora" in d["loc"][-1] for d in detail), detail
        nan = json.dumps({"input": {**base, "lora_weights": str(loras["A"])}})[:-2] + ', "lora_scale": NaN}}'
        r = client.post("/predictions", content=nan, headers={"content-type": "application/json"})
        assert r.status_code == 422 and "lora_scale" in r.text, r.text
        r = client.post("/v1/images/generations", json={"prompt": "x", "lora_weights": str(loras["rank200"])})
        assert r.status_code == 422 and r.json()["error"]["param"] == "lora_weights", r.text
        assert "buckets: 16, 32, 64, 128" in r.json()["error"]["message"]
        good = client.post("/predictions", json={"input": {**base, "lora_weights": str(loras["A"])}})
        assert good.status_code == 200 and good.json()["status"] == "succeeded", good.text
        assert metric(client.get("/metrics").text, *TRAFFIC) == 0


def test_a_lora_url_on_a_private_address_is_refused_before_any_request(core, loras):
    """The client chose the URL: as for webhooks, the server fetches from public addresses only
    (unless --lora-url-allow(-private) says otherwise), checked at connect time."""
    import httpx

    from tests._support.file_server import FileServer

    files = FileServer().start()
    files.files["/a.safetensors"] = loras["A"].read_bytes()
    try:
        with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
            wait_status(client, "READY")
            for url in (files.url("a.safetensors"), files.url("a.safetensors").replace("127.0.0.1", "localhost")):
                r = client.post("/predictions", json={"input": {"prompt": "x", "num_inference_steps": 1,
                                                                "lora_weights": url}})
                assert r.status_code == 422, r.text
                (detail,) = r.json()["detail"]
                assert detail["loc"][-1] == "lora_weights" and "\n" not in detail["msg"], detail
                assert "is loopback; LoRA and image URLs are fetched from public addresses only" in detail["msg"], detail
        assert files.hits == []  # refused before connecting: the file server saw no request
    finally:
        files.stop()


def test_a_policy_that_admits_the_address_fetches_the_lora(sd_pipe, loras, tmp_path, monkeypatch):
    """``--lora-url-allow 127.0.0.1`` (CoreConfig.lora_urls): the same URL is fetched, once."""
    from preheat.server.fetch import FetchConfig, Fetcher
    from preheat.server.inputs import _lora
    from preheat.server.webhooks import WebhookPolicy
    from tests._support.file_server import FileServer

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    files = FileServer().start()
    files.files["/a.safetensors"] = loras["A"].read_bytes()
    try:
        errors: list = []
        url = files.url("a.safetensors")
        lora, bucket = _lora(sd_pipe, {"lora_weights": url, "lora_scale": 0.5}, errors, None,
                             Fetcher(FetchConfig(policy=WebhookPolicy(allow=("127.0.0.1",)))))
        assert errors == [] and lora[1] == 0.5 and bucket == 16 and lora[0].rank == 4
        assert [h.status for h in files.hits] == [200]
    finally:
        files.stop()


def test_runpod_takes_the_same_lora_fields_and_errors(core, loras, sd_pipe):
    job = {"prompt": "a photo of a cat", "num_inference_steps": 2, "seed": 3, "lora_weights": str(loras["B"]),
           "lora_scale": 0.5}
    result, bad, nan = runpod_jobs(core, {"id": "lora", "input": job},
                                   {"id": "bad", "input": {**job, "lora_weights": str(loras["unknown"])}},
                                   {"id": "nan", "input": {**job, "lora_scale": float("nan")}})
    assert "error" not in result, result
    want = sd_pipe.generate("a photo of a cat", steps=2, seed=[3], lora=[[(str(loras["B"]), 0.5)]])
    np.testing.assert_array_equal(decode_data_url(result["images"][0]), want[0])  # bucket 1 both: bit-exact
    assert bad["error"].startswith("lora_weights") and "match no layer" in bad["error"] and "\n" not in bad["error"]
    assert "lora_scale" in nan["error"]


def test_a_server_reads_local_lora_files_only_under_its_lora_dir(tmp_path):
    from preheat.errors import InvalidArgumentError
    from preheat.server.inputs import lora_source

    inside = tmp_path / "loras"
    inside.mkdir()
    assert lora_source("style.safetensors", str(inside)) == str((inside / "style.safetensors").resolve())
    assert lora_source(str(inside / "sub" / "x.safetensors"), str(inside)) == str((inside / "sub" / "x.safetensors").resolve())
    for source in ("https://host/l.safetensors", "hf://org/repo/l.safetensors"):
        assert lora_source(source, None) == source  # fetched through the weights store
    (tmp_path / "loras-evil").mkdir()
    for source, lora_dir, words in [("/etc/hostname", str(inside), "not under"), ("../loras-evil/x", str(inside), "not under"),
                                    ("style.safetensors", None, "--lora-dir"), ("s3://b/k", str(inside), "s3://")]:
        with pytest.raises(InvalidArgumentError, match=words) as err:
            lora_source(source, lora_dir)
        assert "\n" not in str(err.value) and err.value.argument == "lora_weights"


def test_stalled_lora_urls_hold_only_the_fetch_slots(sd_pipe, loras, tmp_path, monkeypatch):
    """The probe's finding: 8 URLs to hosts that accept and never answer held every worker thread,
    and a LoRA from --lora-dir then got no answer. Now they hold the fetch slots only: requests
    without a LoRA, a local LoRA and a URL LoRA already stored are answered while every slot (and
    the waiting line) is still stalled, and nothing the tarpits sent is left in the store."""
    import asyncio

    import httpx

    from preheat.server.fetch import FetchConfig
    from preheat.server.webhooks import WebhookPolicy
    from tests._support.fetch_servers import RawServer, stored_files, tarpit
    from tests._support.file_server import FileServer

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    files = FileServer().start()
    files.files["/c.safetensors"] = loras["C"].read_bytes()
    pits = [RawServer(tarpit, f"127.0.0.{i}") for i in (2, 3, 4)]
    core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=0, max_steps=30, guidance=("on",), lora_ranks=(16,),
                           lora_dir=str(loras["A"].parent), lora_urls=WebhookPolicy(allow=("127.0.0.0/8",)), inputs=(),
                           fetch=FetchConfig(per_host=2, max_fetches=4, max_waiting=4, deadline_s=300)),
                pipe=sd_pipe)
    core.start()
    try:
        assert core.wait_setup(900) and core.setup.status == "succeeded", core.setup.logs
        base = {"prompt": "a cat", "num_inference_steps": 1, "seed": 1}
        with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
            wait_status(client, "READY")
            stored_url = files.url("c.safetensors")
            assert client.post("/predictions", json={"input": {**base, "lora_weights": stored_url}}).status_code == 200
            before = stored_files(tmp_path / "home")

            async def stall() -> list:
                async with httpx.AsyncClient(base_url=server.url, timeout=300) as ac:
                    return await asyncio.gather(*[ac.post("/predictions", json={"input": {
                        **base, "lora_weights": pits[i % 3].url(f"{i}.safetensors")}}) for i in range(8)])

            stalled: dict = {}
            t = threading.Thread(target=lambda: stalled.update(r=asyncio.run(stall())))
            t.start()
            wait_until(lambda: core.fetcher.in_flight == 4 and core.fetcher._waiting == 4, what="every slot stalled")
            answers = _post_all(client, [{"input": base}, {"input": {**base, "lora_weights": "a.safetensors"}},
                                         {"input": {**base, "lora_weights": stored_url}}] * 2)
            assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
            assert core.fetcher.in_flight == 4 and t.is_alive()  # answered while the tarpits still held every slot
            for pit in pits:
                pit.stop()
            t.join(120)
            codes = [r.status_code for r in stalled["r"]]
            assert codes == [422] * 8, [r.text for r in stalled["r"]]
            assert all(r.json()["detail"][0]["loc"][-1] == "lora_weights" for r in stalled["r"])
            assert stored_files(tmp_path / "home") == before
            assert [h.status for h in files.hits] == [200]  # the stored LoRA was fetched once
    finally:
        for pit in pits:
            pit.stop()
        files.stop()
        core.close()
