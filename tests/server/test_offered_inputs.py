"""A server that offers only some of its family's optional inputs (``--inputs``, ``PREHEAT_INPUTS``,
``CoreConfig.inputs``): a text-only SD 1.x server warms only the text programs, draws what a
default server (every input offered) draws, refuses an image, a mask or a negative prompt on
every route in one line naming the field and the ``--inputs`` that offers it, and leaves them
out of its schema. Real HTTP on 127.0.0.1; one tiny SD 1.x pipeline, so the default server
compiles only the image programs the text-only one did not."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator

import numpy as np
import pytest

import preheat
from preheat.server.config import CoreConfig
from preheat.server.core import Core
from preheat.server.images import decode_data_url
from tests._support.image_files import data_uri, png
from tests._support.sd_fixtures import save_tiny_sd
from tests._support.server_fixtures import metric, runpod_jobs, serving, wait_status

# one size, batch 1, unguided: the smallest set with SD 1.x's image variants (a negative prompt
# is a variant of guided programs only: tests/cache/test_warm_declaration.py counts those)
BASE = CoreConfig(max_batch_size=1, batch_wait_ms=0, max_steps=30, sizes=((32, 32),), guidance=("off",))
CALL = {"prompt": "a watercolor fox", "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 4}
GREY = np.full((32, 32, 3), 128, np.uint8)
WHITE = np.full((32, 32), 255, np.uint8)
REFUSED_IMAGE = "image is not served here (start the server with --inputs image, or PREHEAT_INPUTS=image, to offer it)"


def started(config: CoreConfig, pipe: Any) -> Core:
    core = Core(config, pipe=pipe).start()
    assert core.wait_setup(900) and core.setup.status == "succeeded", core.setup.logs
    return core


def warmed(core: Core) -> list[str]:
    """The warm-up's log lines, one per program compiled (or loaded) before READY."""
    return [line for line in core.setup.logs if "warm-up: " in line]


@pytest.fixture(scope="module")
def sd_pipe(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return preheat.load(save_tiny_sd(tmp_path_factory.mktemp("offered") / "sd1", kind="sd1"), cache="off")


@pytest.fixture(scope="module")
def text_only(sd_pipe: Any) -> Iterator[Core]:
    core = started(replace(BASE, inputs=()), sd_pipe)
    yield core
    core.close()


@pytest.fixture(scope="module")
def everything(sd_pipe: Any, text_only: Core) -> Iterator[Core]:
    """The default declaration (after the text-only server: the pipeline holds its programs)."""
    core = started(BASE, sd_pipe)
    yield core
    core.close()


def test_a_text_only_server_warms_only_the_text_programs(text_only: Core, everything: Core) -> None:
    text, full = text_only.signatures(), everything.signatures()
    # the default warms every variant SD 1.x declares unguided: text, img2img and inpaint; the
    # text-only server the one that gives none of them
    assert [s.variant for s in full] == [(), ("image", "strength"), ("image", "mask_image", "strength")]
    assert text == [s for s in full if not s.variant]
    assert len(warmed(text_only)) == 1 and len(warmed(everything)) == 3, (text_only.setup.logs, everything.setup.logs)
    assert text_only.warm.inputs == () and everything.warm.inputs == ("negative_prompt", "image", "mask_image")


def test_a_text_request_is_pixel_equal_to_the_default_servers(text_only: Core, everything: Core) -> None:
    import httpx

    images = []
    for core in (text_only, everything):
        with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
            wait_status(client, "READY")
            before = metric(client.get("/metrics").text, "preheat_compiles_total", '{phase="traffic"}')
            r = client.post("/predictions", json={"input": CALL})
            assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
            images.append(decode_data_url(r.json()["output"][0]))
            assert metric(client.get("/metrics").text, "preheat_compiles_total", '{phase="traffic"}') == before
    np.testing.assert_array_equal(images[0], images[1])


def test_inputs_not_offered_are_refused_on_every_route_in_one_line(text_only: Core) -> None:
    import httpx

    image = data_uri(png(GREY))
    with serving(text_only) as server, httpx.Client(base_url=server.url, timeout=300) as client:
        wait_status(client, "READY")
        r = client.post("/predictions", json={"input": {**CALL, "image": image}})
        assert r.status_code == 422, r.text
        assert REFUSED_IMAGE in r.text and "image: image is not served here" not in r.text, r.text
        r = client.post("/predictions", json={"input": {**CALL, "image": image, "mask": data_uri(png(WHITE))}})
        assert r.status_code == 422 and "--inputs image,mask_image" in r.text, r.text
        r = client.post("/predictions", json={"input": {**CALL, "negative_prompt": "blurry"}})
        assert r.status_code == 422 and "negative_prompt is not served here" in r.text, r.text
        r = client.post("/predictions", json={"input": {**CALL, "strength": 0.5}})  # needs the image
        assert r.status_code == 422 and "strength is not served here" in r.text, r.text

        r = client.post("/v1/images/generations", json={"prompt": "x", "negative_prompt": "blurry"})
        error = r.json()["error"]
        assert r.status_code == 422 and error["param"] == "negative_prompt", r.text
        assert "\n" not in error["message"] and "--inputs negative_prompt" in error["message"], error
        r = client.post("/v1/images/edits", data={"prompt": "x"}, files=[("image", ("i.png", png(GREY), "image/png"))])
        error = r.json()["error"]
        assert r.status_code == 422 and error["param"] == "image" and "image is not served here" in error["message"]

    (result,) = runpod_jobs(text_only, {"id": "img", "input": {**CALL, "image": image}})
    assert result["error"].startswith("image: image is not served here") and "\n" not in result["error"], result


def test_the_schema_holds_only_what_is_offered(text_only: Core, everything: Core) -> None:
    import httpx

    props = {}
    for name, core in (("text", text_only), ("full", everything)):
        with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
            wait_status(client, "READY")
            schema = client.get("/openapi.json").json()
            props[name] = schema["components"]["schemas"]["Input"]["properties"]
            form = schema["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]
            props[name + "-edit"] = form["schema"]["properties"]["image"]["description"]
    optional = {"negative_prompt", "image", "mask", "strength", "padding_mask_crop"}
    assert optional <= set(props["full"]) and not optional & set(props["text"])
    assert "prompt" in props["text"] and "refused" in props["text-edit"] and "refused" not in props["full-edit"]


def test_runpod_reads_the_offered_inputs_from_the_environment(sd_pipe: Any, everything: Core) -> None:
    """An image offered without its mask (the default server has compiled both programs: none here)."""
    import preheat.integrations.runpod as rp

    config = rp.config_from_env({"PREHEAT_INPUTS": "image", "PREHEAT_MAX_BATCH_SIZE": "1", "PREHEAT_SIZES": "32x32",
                                 "PREHEAT_GUIDANCE": "off", "PREHEAT_BATCH_WAIT_MS": "0"})
    assert config.inputs == ("image",)
    assert rp.config_from_env({"PREHEAT_INPUTS": "none"}).inputs == () and rp.config_from_env({}).inputs is None
    core = started(config, sd_pipe)
    try:
        assert [s.variant for s in core.signatures()] == [(), ("image", "strength")]
        image = data_uri(png(GREY))
        ok, refused = runpod_jobs(core, {"id": "img", "input": {**CALL, "image": image, "strength": 0.5}},
                                  {"id": "mask", "input": {**CALL, "image": image, "mask": data_uri(png(WHITE))}})
        assert "error" not in ok, ok
        want = sd_pipe.generate(CALL["prompt"], image=GREY, strength=0.5, steps=2, guidance=1.0, seed=4,
                                width=32, height=32)
        np.testing.assert_array_equal(decode_data_url(ok["images"][0]), want[0])
        assert refused["error"] == ("mask: mask is not served here (start the server with --inputs image,mask_image, "
                                    "or PREHEAT_INPUTS=image,mask_image, to offer it)")
    finally:
        core.close()


def test_an_input_the_family_does_not_declare_fails_set_up_in_one_line(sd_pipe: Any) -> None:
    core = Core(replace(BASE, inputs=("class_label",)), pipe=sd_pipe).start()
    try:
        assert core.wait_setup(300) and core.setup.status == "failed"
        assert core.setup.error == ("--inputs 'class_label' is not an optional input of a stable-diffusion model: its "
                                    "optional inputs are negative_prompt, image, mask_image (or none); prompt always "
                                    "offered"), core.setup.error
    finally:
        core.close()


@pytest.mark.parametrize("env, error", [
    ({"PREHEAT_INPUTS": "class_label"}, "PREHEAT_INPUTS 'class_label' is not an optional input of a stable-diffusion "
                                        "model: its optional inputs are negative_prompt, image, mask_image (or none); "
                                        "prompt always offered"),
    ({"PREHEAT_INPUTS": "none,image"}, "PREHEAT_INPUTS none stands alone: it offers only the required inputs; prompt "
                                       "always offered"),
    ({"PREHEAT_SIZES": "33x33"}, "PREHEAT_SIZES 33x33: width=33 must be a multiple of 2 for this model"),
])
def test_a_set_up_error_names_the_variable_a_runpod_worker_was_given(sd_pipe: Any, env: dict, error: str) -> None:
    """Runpod reads its settings from the environment: a set-up error names the variable
    (``PREHEAT_INPUTS``), not the command line's ``--inputs`` (the test above)."""
    from preheat.integrations import runpod as rp

    core = Core(rp.config_from_env({**env, "PREHEAT_MAX_BATCH_SIZE": "1"}), pipe=sd_pipe).start()
    try:
        assert core.wait_setup(300) and core.setup.status == "failed"
        assert core.setup.error.startswith(error) and "--inputs" not in core.setup.error, core.setup.error
    finally:
        core.close()
