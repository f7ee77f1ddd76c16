"""SDXL's ensemble of experts behind the surfaces: ``CoreConfig(refiner=...)`` loads it (what
``preheat serve --refiner`` and ``PREHEAT_REFINER`` set), warm-up compiles the refiner's encoder
and the two-expert loop, one request over real HTTP on 127.0.0.1 runs without compiling and returns
the Python call's pixels; ``preheat sample --refiner`` writes the Python call's image, and without
it a refiner's flag says what it needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from preheat.server.images import decode_data_url
from tests._support import image_fixtures
from tests._support.server_fixtures import served_core, wait_status

pytestmark = pytest.mark.slow  # builds two tiny pipelines, warms a server and runs the CLI: compiles


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, Path, Path]]:
    from preheat.server.config import CoreConfig

    root = tmp_path_factory.mktemp("ensemble")
    base = image_fixtures.save_image_sd(root / "base", "sdxl")
    refiner = image_fixtures.save_image_sd(root / "refiner", "sdxl-refiner", seed=3)
    config = CoreConfig(model=str(base), refiner=str(refiner), cache="off", max_batch_size=1, batch_wait_ms=0,
                        guidance=("on",), sizes=((32, 32),), inputs=())
    with served_core(config) as (core, server):
        yield core, server.url, base, refiner


def test_a_served_ensemble_request_is_warm_and_matches_the_python_call(served) -> None:
    import httpx

    core, url, _, _ = served
    pipe = core.pipe
    assert pipe.fingerprint["refiner"]["family"] == "stable-diffusion-xl-refiner"
    call = {"prompt": "a red boat", "num_inference_steps": 4, "guidance_scale": 5, "seed": 3, "denoising_end": 0.6,
            "aesthetic_score": 7.0}
    with httpx.Client(base_url=url, timeout=300) as client:
        wait_status(client, "READY")
        props = client.get("/openapi.json").json()["components"]["schemas"]["Input"]["properties"]
        assert {"denoising_end", "aesthetic_score", "negative_aesthetic_score"} <= set(props)
        assert props["denoising_end"]["default"] == 0.8
        r = client.post("/predictions", json={"input": call})
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
        got = decode_data_url(r.json()["output"][0])
        r = client.post("/predictions", json={"input": {**call, "denoising_end": 1.5}})  # beyond the whole
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "denoising_end", r.text
    assert core.batcher.stats["traffic_compiles"] == 0  # warm-up compiled the refiner's encoder and loop
    want = pipe.generate("a red boat", steps=4, guidance=5.0, seed=3, denoising_end=0.6, aesthetic_score=7.0)[0]
    np.testing.assert_array_equal(got, want)


def test_sample_cli_takes_the_refiner(served, tmp_path: Path) -> None:
    from click.testing import CliRunner
    from PIL import Image

    from preheat.cli import main

    core, _, base, refiner = served
    result = CliRunner().invoke(main, ["sample", str(base), "--refiner", str(refiner), "--denoising-end", "0.5",
                                       "--prompt", "a red boat", "--steps", "4", "--guidance", "4", "--seed", "1",
                                       "--cache", "off", "--out", str(tmp_path / "o.png"),
                                       "--save-images", str(tmp_path / "each")])
    assert result.exit_code == 0, result.output
    want = core.pipe.generate("a red boat", steps=4, guidance=4.0, seed=1, denoising_end=0.5)[0]
    (written,) = sorted((tmp_path / "each").iterdir())
    np.testing.assert_array_equal(np.asarray(Image.open(written).convert("RGB")), want)
    result = CliRunner().invoke(main, ["sample", str(base), "--denoising-end", "0.5", "--prompt", "a red boat",
                                       "--steps", "1", "--cache", "off", "--out", str(tmp_path / "o.png")])
    assert result.exit_code == 2 and "--denoising-end needs a refiner" in result.output, result.output
    assert "--refiner FOLDER" in result.output and result.output.count("\n") == 1
