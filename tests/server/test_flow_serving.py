"""`preheat serve`, the Runpod handler and `preheat sample` with the flow-matching text-to-image
families: FLUX.1 (schnell, dev) and SD3, each image equal to the engine's. Real HTTP on 127.0.0.1.
(The UNet families, SD 1.x/2.x and SDXL, are tests/server/test_text_to_image.py's.)"""

from __future__ import annotations

import numpy as np
import pytest

import preheat
from preheat.server.core import Core, CoreConfig
from preheat.server.images import decode_data_url
from tests._support.server_fixtures import cli_family, metric, openai_image, runpod_jobs, serving


@pytest.mark.parametrize("kind", ["flux-schnell", "flux-dev", "sd3"])
def test_flow_families_serve_from_cog_openai_runpod_and_the_cli(kind, tmp_path_factory, monkeypatch):
    """FLUX.1 (schnell: no guidance; dev: the scale is data, one branch; either: true CFG with a
    negative prompt) and SD3 (CFG, negative prompts) through every surface, each image equal to the
    engine's."""
    import httpx
    from tests._support.flow_fixtures import save_tiny_flow_model

    folder = save_tiny_flow_model(tmp_path_factory.mktemp(f"serve-{kind}") / kind, kind)
    pipe = preheat.load(folder, cache="off")
    fields: dict = {"prompt": "a red fox", "num_inference_steps": 2, "seed": 9}
    call: dict = {}
    if kind == "flux-dev":
        fields["guidance_scale"] = call["guidance"] = 4.0
    elif kind == "flux-schnell":  # served at its card's T5 length (--input-values max_sequence_length=256):
        call["max_sequence_length"] = 256  # a request without the field gets it
    elif kind == "sd3":
        fields.update(negative_prompt="blurry", guidance_scale=4.0)
        call.update(negative_prompt="blurry", guidance=4.0)
    want = pipe.generate("a red fox", steps=2, seed=9, width=32, height=32, **call)
    if kind == "flux-schnell":  # the length is not a no-op: a server that did not fill it in would differ
        assert not np.array_equal(want, pipe.generate("a red fox", steps=2, seed=9, width=32, height=32))
    # SD3's requests below are all guided (CFG): its unguided program is not warmed; FLUX.1's one
    # program is the same for either setting (no CFG branch)
    guided_only = {"guidance": ("on",)} if kind == "sd3" else {}
    if kind.startswith("flux"):  # its true CFG's negative prompt, offered only when declared (warmed with "on")
        guided_only["inputs"] = ("negative_prompt",)
    lengths = {"input_values": (("max_sequence_length", ("256",)),)} if kind == "flux-schnell" else {}
    core = Core(CoreConfig(max_batch_size=1, batch_wait_ms=0, max_steps=30, sizes=((32, 32),), **guided_only,
                           **lengths), pipe=pipe)
    core.start()
    try:
        assert core.wait_setup(900) and core.setup.status == "succeeded", core.setup.logs
        with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
            r = client.post("/predictions", json={"input": {**fields, "width": 32, "height": 32}})
            assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
            np.testing.assert_array_equal(decode_data_url(r.json()["output"][0]), want[0])
            r = client.post("/v1/images/generations", json={"prompt": "a red fox", "size": "32x32", "seed": 2})
            assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
            bad = client.post("/predictions", json={"input": {"prompt": "x", "scheduler": "ddim"}})
            assert bad.status_code == 422 and "scheduler" in bad.text
            if kind == "flux-schnell":  # no guidance input: a scale is refused, the server keeps serving
                bad = client.post("/predictions", json={"input": {"prompt": "x", "guidance_scale": 3.5}})
                assert bad.status_code == 422 and "takes no guidance" in bad.text
        (result,) = runpod_jobs(core, {"id": kind, "input": {**fields, "width": 32, "height": 32}})
        assert "error" not in result, result
        np.testing.assert_array_equal(decode_data_url(result["images"][0]), want[0])
        if kind.startswith("flux"):  # issue 26's proof input: Flux's prompt_2 (T5's prompt) through every surface
            proof = pipe.generate("a red fox", prompt_2="a blue bird", steps=2, seed=9, width=32, height=32, **call)
            assert not np.array_equal(proof, want)
            proof_fields = {**fields, "width": 32, "height": 32, "prompt_2": "a blue bird"}
            with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
                r = client.post("/predictions", json={"input": proof_fields})
                assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
                np.testing.assert_array_equal(decode_data_url(r.json()["output"][0]), proof[0])
                r = client.post("/v1/images/generations", json={**{k: v for k, v in proof_fields.items()
                                                                   if k not in ("width", "height")}, "size": "32x32"})
                assert r.status_code == 200, r.text
                np.testing.assert_array_equal(openai_image(r.json()), proof[0])
            (result,) = runpod_jobs(core, {"id": f"{kind}-proof", "input": proof_fields})
            assert "error" not in result, result
            np.testing.assert_array_equal(decode_data_url(result["images"][0]), proof[0])
            # diffusers' true CFG: its warmed program (guidance "on"), the negatives and the scale as fields
            true_cfg = dict(negative_prompt="blurry", negative_prompt_2="a drawing", true_cfg_scale=3.0)
            guided = pipe.generate("a red fox", steps=2, seed=9, width=32, height=32, **call, **true_cfg)
            assert not np.array_equal(guided, want)
            with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
                r = client.post("/predictions", json={"input": {**fields, "width": 32, "height": 32, **true_cfg}})
                assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
                np.testing.assert_array_equal(decode_data_url(r.json()["output"][0]), guided[0])
                bad = client.post("/predictions", json={"input": {"prompt": "x", "true_cfg_scale": 3.0}})
                assert bad.status_code == 422 and "true_cfg_scale needs negative_prompt" in bad.text
                schema = client.get("/openapi.json").json()["components"]["schemas"]["Input"]["properties"]
                # the server's guidance limit bounds it as it bounds guidance_scale (CoreConfig's default)
                assert {"type": "number", "minimum": 0.0, "maximum": 50.0} in schema["true_cfg_scale"]["anyOf"]
                bad = client.post("/predictions", json={"input": {"prompt": "x", "negative_prompt": "y",
                                                                  "true_cfg_scale": 51}})
                assert bad.status_code == 422 and "true_cfg_scale" in bad.text
                # a T5 length is static: the served one's program (dev: the default 512; schnell: its declared
                # 256), another one refused naming the --input-values that would serve it, not compiled
                served, other = (256, 512) if kind == "flux-schnell" else (512, 256)
                r = client.post("/predictions", json={"input": {**fields, "width": 32, "height": 32,
                                                                "max_sequence_length": served}})
                assert r.status_code == 200, r.text
                np.testing.assert_array_equal(decode_data_url(r.json()["output"][0]), want[0])
                bad = client.post("/predictions", json={"input": {"prompt": "x", "max_sequence_length": other}})
                assert bad.status_code == 422, bad.text
                assert (f"{other} is not served here (another program); served: {served} (start the server with "
                        f"--input-values max_sequence_length={served},{other}, or PREHEAT_INPUT_VALUES="
                        f"max_sequence_length={served},{other}, to serve it)") in bad.text
                length = schema["max_sequence_length"]  # schema-valid input is accepted input, as the sizes' enums
                assert length["default"] == served and {"type": "integer", "enum": [served], "minimum": 1,
                                                        "maximum": 512} in length["anyOf"], length
                assert metric(client.get("/metrics").text, "preheat_compiles_total", '{phase="traffic"}') == 0
    finally:
        core.close()

    assert cli_family(monkeypatch, tmp_path_factory.mktemp(f"cli-{kind}"), folder, pipe, "--width", "32", "--height", "32") == ("stable-diffusion-3" if kind == "sd3" else "flux")
