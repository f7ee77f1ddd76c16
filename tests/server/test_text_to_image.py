"""`preheat serve` and the Runpod handler with the UNet text-to-image families (tiny SD 1.x, SDXL):
Cog's and OpenAI's fields, batching by signature (size included), warm-up of every served size,
and the same pixels as the engine. Real HTTP on 127.0.0.1. (The flow-matching families, FLUX.1
and SD3, are tests/server/test_flow_serving.py's.)"""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.server.core import Core, CoreConfig
from preheat.server.images import decode_data_url
from tests._support.sd_fixtures import save_tiny_sd
from tests._support.server_fixtures import cli_family, metric, openai_image, runpod_jobs, serving, wait_status

SIZES = ((32, 32), (48, 32))


@pytest.fixture(scope="module")
def sd_pipe(tmp_path_factory):
    return preheat.load(save_tiny_sd(tmp_path_factory.mktemp("sd-server") / "sd1", kind="sd1"), cache="off")


@pytest.fixture(scope="module")
def core(sd_pipe):
    # text-to-image programs only (--inputs negative_prompt: no image or mask variants) and guided
    # ones only: every request below is a guided text request but the ones refused at parse time
    core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=0, max_steps=30, sizes=SIZES, guidance=("on",),
                           inputs=("negative_prompt",)), pipe=sd_pipe)
    core.start()
    assert core.wait_setup(900) and core.setup.status == "succeeded", core.setup.logs
    yield core
    core.close()


def test_cog_and_openai_routes_draw_what_the_engine_draws(core, sd_pipe):
    import httpx

    with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
        wait_status(client, "READY")
        compiles_before = metric(client.get("/metrics").text, "preheat_compiles_total", '{phase="traffic"}')
        body = {"input": {"prompt": "a watercolor fox", "negative_prompt": "blurry", "width": 48, "height": 32,
                          "num_outputs": 2, "num_inference_steps": 3, "guidance_scale": 6.0, "seed": 5}}
        r = client.post("/predictions", json=body)
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
        got = np.stack([decode_data_url(u) for u in r.json()["output"]])
        want = sd_pipe.generate("a watercolor fox", n=2, negative_prompt="blurry", width=48, height=32, steps=3,
                                guidance=6.0, seed=5)
        np.testing.assert_array_equal(got, want)  # the same bucket (2): bit-exact

        r = client.post("/v1/images/generations", json={"prompt": "a red fox", "n": 1, "size": "32x32", "seed": 1})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 1
        # every request above used a warmed program: nothing compiled during traffic
        assert metric(client.get("/metrics").text, "preheat_compiles_total", '{phase="traffic"}') == compiles_before

        bad = client.post("/predictions", json={"input": {"prompt": "x", "width": 64, "height": 64}})
        assert bad.status_code == 422 and "64x64 is not served here; sizes: 32x32, 48x32" in bad.text
        assert client.post("/predictions", json={"input": {"class_label": 3}}).status_code == 422
        unguided = client.post("/predictions", json={"input": {"prompt": "x", "negative_prompt": "y",
                                                               "guidance_scale": 1}})
        assert unguided.status_code == 422 and "negative_prompt" in unguided.text
        size = client.post("/v1/images/generations", json={"prompt": "x", "size": "64x64"})
        assert size.status_code == 422 and size.json()["error"]["param"] == "size"

        schema = client.get("/openapi.json").json()
        props = schema["components"]["schemas"]["Input"]["properties"]
        assert props["width"]["anyOf"][0]["enum"] == [32, 48]
        # the family's declared inputs it offers, and only those: a text model names no class label,
        # a text-only server no image
        assert "negative_prompt" in props and "class_label" not in props and "image" not in props
        assert len(core.signatures()) == 2 * 2 * 2  # (no negative prompt, one) x 2 sizes x buckets 1, 2
        assert schema["components"]["schemas"]["Input"]["additionalProperties"] is False


def test_runpod_handler_takes_the_same_fields(core, sd_pipe):
    (result,) = runpod_jobs(core, {"id": "t2i", "input": {"prompt": "a photo of a cat", "seed": 3,
                                                          "num_inference_steps": 2}})
    assert "error" not in result, result
    got = decode_data_url(result["images"][0])
    np.testing.assert_array_equal(got, sd_pipe.generate("a photo of a cat", steps=2, seed=3)[0])


@pytest.mark.parametrize("kind", ["sdxl"])
def test_every_text_family_serves_from_cog_openai_runpod_and_the_cli(kind, tmp_path_factory, monkeypatch):
    """SDXL (a family of its own: two encoders, size ids, zeros for an absent negative prompt)
    through every surface, each image equal to the engine's. SD 2.x shares SD 1.x's family and
    code path (served above); its CLI run is in tests/families."""
    import httpx

    folder = save_tiny_sd(tmp_path_factory.mktemp(f"serve-{kind}") / kind, kind=kind)
    pipe = preheat.load(folder, cache="off")
    # guided text programs only (every request below is a guided text request): no unguided and no
    # image SDXL program to warm
    core = Core(CoreConfig(max_batch_size=1, batch_wait_ms=0, max_steps=30, guidance=("on",),
                           inputs=("negative_prompt",)), pipe=pipe)
    core.start()
    try:
        assert core.wait_setup(900) and core.setup.status == "succeeded", core.setup.logs
        want = pipe.generate("a red fox", negative_prompt="blurry", steps=2, guidance=4.0, seed=9)
        with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
            r = client.post("/predictions", json={"input": {"prompt": "a red fox", "negative_prompt": "blurry",
                                                            "num_inference_steps": 2, "guidance_scale": 4.0,
                                                            "seed": 9}})
            assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
            np.testing.assert_array_equal(decode_data_url(r.json()["output"][0]), want[0])
            r = client.post("/v1/images/generations", json={"prompt": "a red fox", "size": "32x32", "seed": 2})
            assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
        (result,) = runpod_jobs(core, {"id": kind, "input": {"prompt": "a red fox", "negative_prompt": "blurry",
                                                             "num_inference_steps": 2, "guidance_scale": 4.0,
                                                             "seed": 9}})
        assert "error" not in result, result
        np.testing.assert_array_equal(decode_data_url(result["images"][0]), want[0])
        # issue 26's proof inputs reach the image through Cog and Runpod as extra fields, as in Python
        extra = {"prompt_2": "a blue bird", "negative_prompt_2": "dark", "clip_skip": 1, "original_size": [48, 40],
                 "target_size": [32, 32], "crops_coords_top_left": [4, 2]}
        call = {**extra, **{k: tuple(v) for k, v in extra.items() if isinstance(v, list)}}
        proof = pipe.generate("a red fox", negative_prompt="blurry", steps=2, guidance=4.0, seed=9, **call)
        assert not np.array_equal(proof, want)  # the fields change the image
        with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
            r = client.post("/predictions", json={"input": {"prompt": "a red fox", "negative_prompt": "blurry",
                                                            "num_inference_steps": 2, "guidance_scale": 4.0,
                                                            "seed": 9, **extra}})
            assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
            np.testing.assert_array_equal(decode_data_url(r.json()["output"][0]), proof[0])
            # ... and through OpenAI's body, as extra fields by the same names
            r = client.post("/v1/images/generations", json={"prompt": "a red fox", "negative_prompt": "blurry",
                                                             "num_inference_steps": 2, "guidance_scale": 4.0,
                                                             "seed": 9, **extra})
            assert r.status_code == 200, r.text
            np.testing.assert_array_equal(openai_image(r.json()), proof[0])
        (result,) = runpod_jobs(core, {"id": f"{kind}-proof", "input": {"prompt": "a red fox", "negative_prompt": "blurry",
                                                                        "num_inference_steps": 2, "guidance_scale": 4.0,
                                                                        "seed": 9, **extra}})
        assert "error" not in result, result
        np.testing.assert_array_equal(decode_data_url(result["images"][0]), proof[0])
    finally:
        core.close()

    assert cli_family(monkeypatch, tmp_path_factory.mktemp(f"cli-{kind}"), folder, pipe) == ("stable-diffusion-xl" if kind == "sdxl" else "stable-diffusion")
