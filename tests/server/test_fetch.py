"""The one guarded fetch (``preheat.server.fetch``, issue 31) against real misbehaving servers on
127.0.0.1: a tarpit (accepts, never answers), a slow drip, an oversized body with and without
``Content-Length``, redirect chains; one flight per URL; slots per host and in all. After every
refusal the store holds nothing new. The server-level guarantees (requests without URLs and
cached LoRAs answered while every slot is stalled) are tests/server/test_lora_server.py's."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator

import pytest

from preheat.errors import FetchError
from preheat.server.fetch import FetchConfig, Fetcher
from preheat.server.metrics import CoreMetrics, FetchMetrics
from preheat.server.webhooks import WebhookPolicy
from tests._support.fetch_servers import RawServer, drip, endless, stored_files, tarpit
from tests._support.file_server import FileServer
from tests._support.server_fixtures import metric, wait_until

LOOPBACK = WebhookPolicy(allow=("127.0.0.0/8",))
# a safetensors file: 8-byte header length, the JSON header, no tensors
LORA = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def files() -> Iterator[FileServer]:
    server = FileServer().start()
    yield server
    server.stop()


def fetcher(**kw) -> tuple[Fetcher, CoreMetrics]:
    metrics = CoreMetrics()
    return Fetcher(FetchConfig(policy=LOOPBACK, **kw), FetchMetrics(metrics.registry)), metrics


def refusals(metrics: CoreMetrics, reason: str) -> float:
    from prometheus_client import generate_latest

    return metric(generate_latest(metrics.registry).decode(), "preheat_fetch_refusals_total", f'{{reason="{reason}"}}')


def test_a_tarpit_is_cut_at_the_deadline_and_leaves_nothing(home: Path) -> None:
    pit = RawServer(tarpit)
    f, metrics = fetcher(deadline_s=1.5, connect_timeout_s=1.0)
    try:
        with pytest.raises(FetchError) as err:
            f.lora(pit.url("l.safetensors"))
        assert err.value.reason == "deadline" and "\n" not in str(err.value), err.value
        assert pit.accepted >= 1 and f.in_flight == 0
        assert stored_files(home) == set() and refusals(metrics, "deadline") == 1
    finally:
        pit.stop()


def test_a_slow_drip_ends_at_the_deadline_and_its_partial_file_is_removed(home: Path) -> None:
    pit = RawServer(drip)
    f, metrics = fetcher(deadline_s=1.5)
    try:
        with pytest.raises(FetchError) as err:
            f.lora(pit.url("l.safetensors"))
        assert err.value.reason == "deadline", err.value
        assert stored_files(home) == set()  # the bytes that dripped in are gone too
    finally:
        pit.stop()


def test_an_oversized_body_with_content_length_is_refused_before_its_body(home: Path, files: FileServer) -> None:
    files.files["/big.safetensors"] = LORA + b"\0" * (1 << 20)
    f, metrics = fetcher(max_lora_bytes=1000)
    with pytest.raises(FetchError, match="over the 1000-byte limit") as err:
        f.lora(files.url("big.safetensors"))
    assert err.value.reason == "size" and refusals(metrics, "size") == 1
    assert stored_files(home) == set() and metric_bytes(metrics) == 0  # not a byte of the body was read


def test_an_oversized_body_without_content_length_is_cut_while_streaming(home: Path) -> None:
    pit = RawServer(endless)
    f, metrics = fetcher(max_lora_bytes=300_000)
    try:
        with pytest.raises(FetchError, match="over the 300000-byte limit") as err:
            f.lora(pit.url("big.safetensors"))
        assert err.value.reason == "size"
        assert stored_files(home) == set()
        assert 300_000 <= metric_bytes(metrics) <= 300_000 + 256 * 1024  # at most one read past the cap
    finally:
        pit.stop()


def metric_bytes(metrics: CoreMetrics) -> float:
    from prometheus_client import generate_latest

    return metric(generate_latest(metrics.registry).decode(), "preheat_fetch_bytes_total")


def test_redirect_chains_are_followed_and_each_hop_is_checked(home: Path, files: FileServer) -> None:
    files.files["/l.safetensors"] = LORA
    for i in range(3):
        files.redirects[f"/hop{i}"] = files.url(f"hop{i + 1}") if i < 2 else files.url("l.safetensors")
    f, _ = fetcher()
    assert (f.lora(files.url("hop0")) / "hop0").read_bytes() == LORA  # the store names it by the URL asked
    # a hop to an address the policy refuses: refused at connect time, nothing stored
    strict = Fetcher(FetchConfig(policy=WebhookPolicy(allow=("127.0.0.1",))))
    files.redirects["/away"] = files.url("l.safetensors").replace("127.0.0.1", "127.0.0.2")
    before = stored_files(home)
    with pytest.raises(FetchError, match="LoRA and image URLs are fetched from public addresses only") as err:
        strict.lora(files.url("away"))
    assert err.value.reason == "address"
    # an endless chain ends (urllib's hop limit), refused
    files.redirects["/loop"] = files.url("loop2")
    files.redirects["/loop2"] = files.url("loop")
    with pytest.raises(FetchError) as err:
        f.lora(files.url("loop"))
    assert err.value.reason == "http"
    assert stored_files(home) == before


def test_a_download_that_is_not_safetensors_is_not_published(home: Path, files: FileServer) -> None:
    files.files["/junk.safetensors"] = b"<html>not found</html>" * 100
    f, metrics = fetcher()
    with pytest.raises(FetchError, match="not a safetensors file") as err:
        f.lora(files.url("junk.safetensors"))
    assert err.value.reason == "invalid" and refusals(metrics, "invalid") == 1
    assert stored_files(home) == set()


def test_the_same_url_asked_twice_at_once_is_fetched_once(home: Path, files: FileServer) -> None:
    files.files["/l.safetensors"] = LORA + b"\0" * 200_000
    files.chunk, files.pause_after = 1000, 1000
    f, _ = fetcher()
    out: list = []
    threads = [threading.Thread(target=lambda: out.append(f.lora(files.url("l.safetensors")))) for _ in range(3)]
    for t in threads:
        t.start()
    assert files.paused.wait(30)
    wait_until(lambda: len(f._flights) == 1 and f.in_flight == 1, what="one flight")
    files.release.set()
    for t in threads:
        t.join(60)
    assert len(out) == 3 and len(set(out)) == 1
    assert [h.status for h in files.hits] == [200]


def test_slots_per_host_and_in_all_and_the_waiting_line_is_bounded(home: Path, files: FileServer) -> None:
    """Two tarpit hosts: each holds at most per_host slots; the global cap holds; waiting fetches
    past max_waiting are refused at once ("busy"), and a free host is fetched as soon as a slot is."""
    pits = [RawServer(tarpit, "127.0.0.2"), RawServer(tarpit, "127.0.0.3")]
    f, metrics = fetcher(per_host=2, max_fetches=3, max_waiting=2, deadline_s=60)
    errors: list = []

    def fetch(url: str) -> None:
        try:
            f.lora(url)
        except FetchError as err:
            errors.append(err)

    try:
        threads = [threading.Thread(target=fetch, args=(pits[0].url(f"{i}.safetensors"),)) for i in range(3)]
        threads += [threading.Thread(target=fetch, args=(pits[1].url(f"{i}.safetensors"),)) for i in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: f.in_flight == 3 and f._waiting == 2, what="3 running, 2 waiting")
        assert f._hosts == {"127.0.0.2": 2, "127.0.0.3": 1}
        with pytest.raises(FetchError, match="retry later") as err:  # the line is full
            f.lora(files.url("l.safetensors"))
        assert err.value.reason == "busy" and refusals(metrics, "busy") == 1
        for pit in pits:
            pit.stop()  # the stalled fetches now fail fast (connection closed, then refused)
        for t in threads:
            t.join(60)
        assert len(errors) == 5 and f.in_flight == 0 and f._hosts == {}
        files.files["/l.safetensors"] = LORA
        assert f.lora(files.url("l.safetensors")).is_dir()
    finally:
        for pit in pits:
            pit.stop()


def test_an_image_url_is_read_under_the_same_guards_and_never_stored(home: Path, files: FileServer) -> None:
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 5000
    files.files["/i.png"] = png
    files.files["/big.png"] = png * 100
    f, metrics = fetcher(max_image_bytes=100_000)
    assert f.image(files.url("i.png")) == png
    with pytest.raises(FetchError, match="over the 100000-byte limit") as err:
        f.image(files.url("big.png"))
    assert err.value.reason == "size"
    with pytest.raises(FetchError, match="images are fetched from http"):
        f.image("file:///etc/passwd")
    strict = Fetcher(FetchConfig())  # the default policy: public addresses only
    with pytest.raises(FetchError, match="is loopback") as err:
        strict.image(files.url("i.png"))
    assert err.value.reason == "address"
    assert stored_files(home) == set() and [h.path for h in files.hits] == ["/i.png", "/big.png"]
