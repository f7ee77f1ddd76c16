"""A model loaded with a ControlNet behind the surfaces: ``CoreConfig(controlnet=...)`` loads it
(``server.config.load_pipeline``, what ``preheat serve --controlnet`` and ``PREHEAT_CONTROLNET``
set), warm-up compiles the control image's programs at the served size (text-to-image, img2img and
inpainting), a text and an img2img request over real HTTP on 127.0.0.1 run without compiling and
return the Python call's pixels; and ``preheat sample --controlnet CN --control-image FILE`` writes
the Python call's image."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from preheat.server.images import decode_data_url
from tests._support.controlnet_fixtures import control_image, save_tiny_controlnet
from tests._support.image_files import data_uri, png
from tests._support.sd_fixtures import save_tiny_sd
from tests._support.server_fixtures import served_core, wait_status

pytestmark = pytest.mark.slow  # builds a tiny pipeline and ControlNet, warms a server and runs the CLI: compiles


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, Path, Path]]:
    from preheat.server.config import CoreConfig

    base = tmp_path_factory.mktemp("controlnet")
    folder = save_tiny_sd(base / "sd1", "sd1")
    cn = save_tiny_controlnet(base / "cn", folder)
    config = CoreConfig(model=str(folder), controlnet=str(cn), cache="off", max_batch_size=1, batch_wait_ms=0,
                        guidance=("on",), sizes=((32, 32),))
    with served_core(config) as (core, server):
        yield core, server.url, folder, cn


def test_a_served_controlnet_request_is_warm_and_matches_the_python_call(served) -> None:
    import httpx

    core, url, _, _ = served
    pipe = core.pipe
    assert pipe.fingerprint["controlnet"]["config"]["conditioning_embedding_out_channels"] == [16, 32]
    assert all(s.given and dict(s.given).get("control_image") is not None for s in core.signatures())
    image, start = control_image(seed=4), control_image(seed=6)
    call = {"prompt": "a red boat", "num_inference_steps": 3, "guidance_scale": 5, "seed": 3,
            "controlnet_conditioning_scale": 0.7, "control_guidance_start": 0.3}
    with httpx.Client(base_url=url, timeout=300) as client:
        wait_status(client, "READY")
        props = client.get("/openapi.json").json()["components"]["schemas"]["Input"]["properties"]
        assert {"control_image", "controlnet_conditioning_scale", "control_guidance_start",
                "control_guidance_end"} <= set(props)
        bounds = props["control_guidance_end"].get("anyOf", [props["control_guidance_end"]])[0]
        assert (bounds["minimum"], bounds["maximum"]) == (0.0, 1.0), props["control_guidance_end"]
        r = client.post("/predictions", json={"input": {**call, "control_image": data_uri(png(image))}})
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
        got = decode_data_url(r.json()["output"][0])
        r = client.post("/predictions", json={"input": {**call, "control_image": data_uri(png(image)),
                                                        "image": data_uri(png(start)), "strength": 0.7}})
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
        got_img2img = decode_data_url(r.json()["output"][0])
        r = client.post("/predictions", json={"input": {**call, "control_image": data_uri(png(image)),
                                                        "guess_mode": True}})
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
        got_guess = decode_data_url(r.json()["output"][0])
        r = client.post("/predictions", json={"input": call})  # no control image: refused, naming it
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "control_image", r.text
        r = client.post("/predictions", json={"input": {**call, "control_image": data_uri(png(image)),
                                                        "guess_mode": "maybe"}})  # a JSON boolean only
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "guess_mode", r.text
        assert props["guess_mode"].get("anyOf", [props["guess_mode"]])[0]["type"] == "boolean"
    assert core.batcher.stats["traffic_compiles"] == 0  # warm-up compiled the ControlNet's programs (guess mode: data)
    want = pipe.generate("a red boat", steps=3, guidance=5.0, seed=3, control_image=image,
                         controlnet_conditioning_scale=0.7, control_guidance_start=0.3)[0]
    assert got.shape == (32, 32, 3)
    np.testing.assert_array_equal(got, want)
    want = pipe.generate("a red boat", steps=3, guidance=5.0, seed=3, control_image=image, image=start, strength=0.7,
                         controlnet_conditioning_scale=0.7, control_guidance_start=0.3)[0]
    np.testing.assert_array_equal(got_img2img, want)
    assert np.abs(got_img2img.astype(int) - got.astype(int)).mean() > 3  # the image counts
    want = pipe.generate("a red boat", steps=3, guidance=5.0, seed=3, control_image=image, guess_mode=True,
                         controlnet_conditioning_scale=0.7, control_guidance_start=0.3)[0]
    np.testing.assert_array_equal(got_guess, want)
    assert np.abs(got_guess.astype(int) - got.astype(int)).mean() > 3  # guess mode counts


def test_sample_cli_takes_controlnet_and_control_image(served, tmp_path: Path) -> None:
    from click.testing import CliRunner
    from PIL import Image

    from preheat.cli import main

    core, _, folder, cn = served
    image = control_image(seed=5)
    (tmp_path / "edges.png").write_bytes(png(image))
    out = tmp_path / "o.png"
    result = CliRunner().invoke(main, ["sample", str(folder), "--controlnet", str(cn), "--control-image",
                                       str(tmp_path / "edges.png"), "--controlnet-conditioning-scale", "0.5",
                                       "--guess-mode", "true", "--prompt", "a red boat", "--steps", "2", "--guidance",
                                       "4", "--seed", "1", "--cache", "off", "--out", str(out), "--save-images",
                                       str(tmp_path / "each")])
    assert result.exit_code == 0, result.output
    want = core.pipe.generate("a red boat", steps=2, guidance=4.0, seed=1, control_image=image,
                              controlnet_conditioning_scale=0.5, guess_mode=True)[0]
    (written,) = sorted((tmp_path / "each").iterdir())  # the image as made (--out is a grid, upscaled when small)
    np.testing.assert_array_equal(np.asarray(Image.open(written).convert("RGB")), want)
    result = CliRunner().invoke(main, ["sample", str(folder), "--control-image", str(tmp_path / "edges.png"),
                                       "--prompt", "a red boat", "--steps", "1", "--cache", "off",
                                       "--out", str(out)])
    # without --controlnet the model declares no control inputs: one line naming the option that loads one
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: --control-image needs a ControlNet: load the model with --controlnet FOLDER")
    assert result.output.count("\n") == 1


def test_warm_dry_run_declares_the_control_image(served, tmp_path: Path) -> None:
    """``preheat warm --controlnet`` loads the model with it: its required inputs name the control image."""
    import json

    from click.testing import CliRunner

    from preheat.cli import main

    _, _, folder, cn = served
    result = CliRunner().invoke(main, ["warm", str(folder), "--controlnet", str(cn), "--sizes", "32x32",
                                       "--max-batch-size", "1", "--guidance", "on", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    # img2img and inpainting beside the ControlNet, as the model without one offers them
    assert report["inputs"] == {"required": ["prompt", "control_image"],
                                "optional": ["negative_prompt", "image", "mask_image"], "not_offered": []}
    # batch 1, 32x32, guided, the default sampler; a negative prompt or not; from noise, an image, an image and mask
    assert len(report["signatures"]) == 6
