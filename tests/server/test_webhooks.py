"""Webhook policy: which URLs are accepted, where deliveries connect, no redirects.

Nothing here sends anything anywhere but 127.0.0.1: refused URLs are refused before any
connection (literal addresses and ``localhost``, resolved from the hosts file), and the
deliveries that do happen go to listeners on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from preheat.server.core import Core, CoreConfig
from preheat.server.webhooks import WebhookPolicy, WebhookRefused, delivery_client
from tests._support.server_fixtures import metric, serving

REFUSED = [
    ("http://169.254.169.254/latest/meta-data/", "metadata"),
    ("http://[fd00:ec2::254]/", "metadata"),
    ("http://100.100.100.200/latest/", "metadata"),
    ("http://10.0.0.1/", "private"),
    ("http://172.16.3.4:8080/x", "private"),
    ("http://192.168.1.10/", "private"),
    ("http://[fc00::1]/", "private"),
    ("http://127.0.0.1:9/", "loopback"),
    ("http://localhost:6379/", "loopback"),
    ("http://[::1]:22/", "loopback"),
    ("http://[::ffff:127.0.0.1]/", "loopback"),
    ("http://169.254.1.1/", "link-local"),
    ("http://[fe80::1]/", "link-local"),
    ("http://224.0.0.1/", "multicast"),
    ("http://[ff02::1]/", "multicast"),
    ("http://0.0.0.0/", "unspecified"),
    ("http://100.64.0.1/", "not a public address"),
    ("ftp://10.0.0.1/file", "scheme"),
    ("file:///etc/passwd", "scheme"),
]


def _resolve(policy: WebhookPolicy, url: str) -> Any:
    return asyncio.run(policy.resolve(url))


@pytest.mark.parametrize(("url", "why"), REFUSED, ids=[u for u, _ in REFUSED])
def test_default_policy_refuses_every_non_public_address(url: str, why: str) -> None:
    with pytest.raises(WebhookRefused, match=why):
        _resolve(WebhookPolicy(), url)


def test_a_public_address_is_pinned() -> None:
    target = _resolve(WebhookPolicy(), "https://8.8.8.8:8443/hook?x=1")  # a literal: nothing is looked up or sent
    assert (target.url, target.host, target.sni) == ("https://8.8.8.8:8443/hook?x=1", "8.8.8.8:8443", "8.8.8.8")


def test_a_host_name_is_connected_by_the_address_that_was_checked() -> None:
    target = _resolve(WebhookPolicy(allow=("localhost",)), "http://localhost:8123/hook")
    resolved = {info[4][0] for info in socket.getaddrinfo("localhost", 8123, type=socket.SOCK_STREAM)}
    host = httpx.URL(target.url).host
    assert host in resolved and target.host == "localhost:8123" and target.sni is None


def test_allow_private_and_the_allow_list() -> None:
    private = WebhookPolicy(allow_private=True)
    for url in ("http://10.0.0.1/", "http://127.0.0.1:9/", "http://[::1]:22/", "http://localhost:6379/"):
        _resolve(private, url)
    with pytest.raises(WebhookRefused, match="metadata"):  # never by allow_private alone
        _resolve(private, "http://169.254.169.254/")
    listed = WebhookPolicy(allow=("10.0.0.0/8", "169.254.169.254"))
    _resolve(listed, "http://10.1.2.3/")
    _resolve(listed, "http://169.254.169.254/")
    with pytest.raises(WebhookRefused, match="private"):
        _resolve(listed, "http://192.168.1.10/")
    with pytest.raises(WebhookRefused, match="CIDR"):
        WebhookPolicy(allow=("10.0.0.0/99",))


class _Listener:
    """A 127.0.0.1 HTTP endpoint answering every POST with ``status`` (+ Location); it records
    the requests it got."""

    def __init__(self, status: int = 200, location: str = "") -> None:
        self.requests: list[dict] = []
        requests = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                requests.append({"path": self.path, "host": self.headers["Host"]})
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_delivery_does_not_follow_redirects() -> None:
    target, redirector = _Listener(), None
    try:
        redirector = _Listener(status=307, location=target.url)
        policy = WebhookPolicy(allow=("127.0.0.1",))

        async def deliver() -> int:
            async with delivery_client() as client:
                return (await policy.post(client, redirector.url, {"id": "x"})).status_code

        assert asyncio.run(deliver()) == 307  # the redirect came back as the answer ...
        assert len(redirector.requests) == 1 and redirector.requests[0]["host"] == redirector.url.split("/")[2]
        assert target.requests == []  # ... and was not followed (post() returned after the one exchange)
    finally:
        target.close()
        if redirector is not None:
            redirector.close()


@pytest.fixture(scope="module")
def strict_server(pipe: Any):
    core = Core(CoreConfig(max_batch_size=1, batch_wait_ms=0), pipe=pipe).start()
    assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
    with serving(core) as srv:  # the default policy
        yield core, srv
    core.close()


def test_refused_webhooks_are_422_before_anything_is_sent(strict_server: Any) -> None:
    core, srv = strict_server
    listener = socket.socket()  # would see a connection if anything tried to reach it
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    local = f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            before = c.get("/metrics").text
            for url in [local, *(u for u, _ in REFUSED if u.startswith("http"))]:
                for prefer in ({"Prefer": "respond-async"}, {}):
                    r = c.post("/predictions", json={"input": {"seed": 1}, "webhook": url}, headers=prefer)
                    assert r.status_code == 422, (url, r.status_code, r.text)
                    assert any(e["loc"] == ["body", "webhook"] for e in r.json()["detail"]), r.json()
            after = c.get("/metrics").text
        total = 'preheat_predictions_total'
        assert sum(metric(after, total, f'{{status="{s}"}}') - metric(before, total, f'{{status="{s}"}}')
                   for s in ("succeeded", "failed", "canceled")) == 0  # no prediction was created
        assert core.queue_depth == 0
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()
