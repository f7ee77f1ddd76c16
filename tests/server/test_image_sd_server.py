"""A real image-conditioned family behind the server: a tiny SD 1.x folder (img2img and mask
blending from ``preheat.families.image``'s declarations) served at two sizes. Warm-up compiles
the VAE encoder and each image variant at every served size, so image requests never compile,
and what the server returns is what ``Pipeline.generate`` makes from the same inputs -- an
inpainting call's ``padding_mask_crop`` too (a field derived from its declaration, on Cog, Runpod
and OpenAI's edits form: the crop runs the warmed programs, and the output is the image's size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import preheat
from preheat.server.images import decode_data_url
from tests._support import image_fixtures
from tests._support.image_files import data_uri, png
from tests._support.server_fixtures import runpod_jobs, serving, wait_status

SIZES = ((32, 32), (48, 32))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, Any]]:
    from preheat.server.config import CoreConfig
    from preheat.server.core import Core

    folder = image_fixtures.save_image_sd(tmp_path_factory.mktemp("sd") / "sd1", "sd1")
    pipe = preheat.load(folder, cache="off")
    core = Core(CoreConfig(max_batch_size=1, batch_wait_ms=0, guidance=("off",), sizes=SIZES), pipe=pipe).start()
    try:
        assert core.wait_setup(900) and core.setup.status == "succeeded", core.setup.logs
        with serving(core) as server:
            yield core, server.url, pipe
    finally:
        core.close()


def test_warm_up_covers_the_encoder_at_every_served_size(served) -> None:
    from preheat.warm import programs

    core, _, pipe = served
    sigs = core.signatures()
    assert {(s.size, s.variant) for s in sigs} == {(size, v) for size in SIZES
                                                    for v in ((), ("image", "strength"), ("image", "mask_image", "strength"))}
    image_sig = next(s for s in sigs if s.variant == ("image", "strength") and s.size == (48, 32))
    assert "encode_image" in [p["stage"] for p in programs(pipe, image_sig)]


def test_image_requests_run_without_compiling_and_match_the_python_call(served) -> None:
    import httpx

    core, url, pipe = served
    image, mask = image_fixtures.sample_image(), image_fixtures.sample_mask()
    call = {"prompt": "a red boat", "num_inference_steps": 2, "guidance_scale": 1, "seed": 3, "width": 48,
            "height": 32, "strength": 0.6}
    with httpx.Client(base_url=url, timeout=300) as client:
        wait_status(client, "READY")
        mask_uri = data_uri(png(mask))
        for extra, kwargs in [({}, {}), ({"mask": mask_uri}, {"mask_image": mask}),
                              ({"mask": mask_uri, "padding_mask_crop": 2}, {"mask_image": mask, "padding_mask_crop": 2})]:
            r = client.post("/predictions", json={"input": {**call, "image": data_uri(png(image)), **extra}})
            assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
            got = decode_data_url(r.json()["output"][0])
            want = pipe.generate("a red boat", steps=2, guidance=1.0, seed=3, width=48, height=32, strength=0.6,
                                 image=image, **kwargs)[0]
            assert got.shape == ((32, 32, 3) if "padding_mask_crop" in extra else (32, 48, 3))  # the image's size
            np.testing.assert_array_equal(got, want)
        (job,) = runpod_jobs(core, {"id": "crop", "input": {**call, "image": data_uri(png(image)), **extra}})
        np.testing.assert_array_equal(decode_data_url(job["images"][0]), want)
        # OpenAI's edits form takes it as a declared field too; its mask is transparent = edit
        binary = np.where(mask >= 128, 255, 0).astype(np.uint8)
        rgba = np.dstack([np.full(mask.shape + (3,), 90, np.uint8), np.where(binary == 255, 0, 255).astype(np.uint8)])
        form = {"prompt": "a red boat", "num_inference_steps": "2", "guidance_scale": "1", "seed": "3",
                "size": "48x32", "strength": "0.6", "padding_mask_crop": "2"}
        r = client.post("/v1/images/edits", data=form, files=[("image", ("i.png", png(image), "image/png")),
                                                              ("mask", ("m.png", png(rgba), "image/png"))])
        assert r.status_code == 200, r.text
        got = decode_data_url("data:image/png;base64," + r.json()["data"][0]["b64_json"])
        want = pipe.generate("a red boat", steps=2, guidance=1.0, seed=3, width=48, height=32, strength=0.6,
                             image=image, mask_image=binary, padding_mask_crop=2)[0]
        np.testing.assert_array_equal(got, want)
        r = client.post("/predictions", json={"input": {**call, "strength": 0}})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "strength", r.text
        r = client.post("/predictions", json={"input": {**call, "image": data_uri(png(image)), "padding_mask_crop": 2}})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "padding_mask_crop", r.text
    assert core.batcher.stats["traffic_compiles"] == 0


def test_a_sampler_error_names_each_input_by_the_surface_s_own_name(served, monkeypatch, tmp_path: Path) -> None:
    """A schedule's refusal (``SchedulerConfigError``: a strength too small for the steps, custom
    timesteps for a sampler that takes none) is worded with each surface's names for the inputs it
    names: Cog, OpenAI's routes and Runpod say num_inference_steps and scheduler, the CLI --steps and
    --sampler; never the engine's steps= or sampler."""
    import httpx
    from click.testing import CliRunner

    from preheat.cli import main

    core, url, pipe = served
    sampler = pipe.defaults["sampler"]
    image = image_fixtures.sample_image()
    few = ("strength", "strength=0.1 with num_inference_steps=2 runs no step; raise strength or num_inference_steps")
    custom = ("timesteps", f"timesteps is not supported for scheduler {sampler!r}; only lcm, tcd take it")
    base = {"prompt": "a red boat", "num_inference_steps": 2, "guidance_scale": 1, "seed": 3}
    few_input = {**base, "image": data_uri(png(image)), "strength": 0.1}
    custom_input = {**base, "timesteps": [800, 400]}
    with httpx.Client(base_url=url, timeout=300) as client:
        wait_status(client, "READY")
        for raw, (field, message) in ((few_input, few), (custom_input, custom)):
            r = client.post("/predictions", json={"input": raw})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == field, r.text
            assert r.json()["detail"][0]["msg"] == message, r.text
            (job,) = runpod_jobs(core, {"id": field, "input": raw})
            assert job["error"] == f"{field}: {message}", job
        r = client.post("/v1/images/generations", json={**custom_input, "n": 1})
        assert r.status_code == 422 and r.json()["error"]["message"] == f"timesteps: {custom[1]}", r.text
        r = client.post("/v1/images/edits", data={"prompt": "a red boat", "num_inference_steps": "2", "strength": "0.1"},
                        files=[("image", ("i.png", png(image), "image/png"))])
        assert r.status_code == 422 and r.json()["error"]["message"] == f"strength: {few[1]}", r.text

    monkeypatch.setattr(preheat, "load", lambda *a, **k: pipe)
    (tmp_path / "i.png").write_bytes(png(image))
    for flags, line in (
            (["--image", str(tmp_path / "i.png"), "--strength", "0.1"],
             "error: --strength=0.1 with --steps=2 runs no step; raise --strength or --steps"),
            (["--timesteps", "800,400"],
             f"error: --timesteps is not supported for --sampler {sampler!r}; only lcm, tcd take it")):
        result = CliRunner().invoke(main, ["sample", "--prompt", "a red boat", "--steps", "2", "--guidance", "1",
                                           *flags, "--out", str(tmp_path / "o.png")])
        assert result.exit_code == 2 and result.output.strip() == line, result.output
