"""The server's start-up contract: a --sizes the model cannot serve fails at start in one line;
/metrics has every labelled series from the first scrape (zeros); /docs is one self-contained
page (no CDN), served on 127.0.0.1 to a real HTTP client."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from preheat.server.core import Core, CoreConfig
from tests._support.server_fixtures import serving


@pytest.fixture(scope="module")
def client(pipe: Any):
    core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=0), pipe=pipe)  # not started: no set-up yet
    with serving(core) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_metrics_series_exist_from_the_start(client):
    text = client.get("/metrics").text
    for sample in ('preheat_compiles_total{phase="traffic"} 0.0',
                   'preheat_predictions_total{status="succeeded"} 0.0',
                   'preheat_predictions_total{status="failed"} 0.0',
                   'preheat_warmup_programs_total{cache_layer="none"} 0.0',
                   'preheat_warmup_programs_total{cache_layer="aot"} 0.0'):
        assert re.search(rf"^{re.escape(sample)}$", text, re.M), sample


def test_docs_is_a_self_contained_page(client):
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "/predictions" in page and "/v1/images/generations" in page and 'href="/openapi.json"' in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "an asset from elsewhere"
    assert "<script" not in page and "cdn" not in page.lower()
    assert "num_inference_steps" in page  # the input schema's fields, from the app's OpenAPI document
    assert client.get("/redoc").status_code == 404


def test_sizes_a_model_cannot_serve_fail_at_start(pipe, model_dir):
    from preheat.warm import WarmSet, resolve
    from preheat.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=r"^--sizes 33x33: width=33: this model makes 16x16 images only$"):
        resolve(pipe, WarmSet(sizes=((33, 33),)))
    assert resolve(pipe, WarmSet(sizes=((16, 16),))).sizes == ((16, 16),)  # its own size is fine
    from preheat.cli import main

    r = CliRunner().invoke(main, ["warm", str(model_dir), "--sizes", "33x33", "--dry-run"])
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == ["error: --sizes 33x33: width=33: this model makes 16x16 images only"]
