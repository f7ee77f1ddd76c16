"""Image inputs on every server surface, through a real HTTP client against a real server on
127.0.0.1, with the toy image family (``tests/families/toy/family.py``: a black mask returns the
image's own pixels, so what arrived can be read back).

    Cog           image / mask as data URIs or http(s) URLs (the guarded fetch: the address
                  policy before any connection, nothing stored); the OpenAPI schema states them
    OpenAI        POST /v1/images/edits, multipart; transparent = edit becomes white = repaint
    Runpod        the same fields through the handler
    bad input     each a one-line 422 naming its field: the pixel limit, a bomb, a format,
                  a truncated file, a mask of another size, strength outside (0, 1], a path
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import preheat
from preheat.image_input import MAX_IMAGE_PIXELS, set_max_pixels
from preheat.server.images import decode_data_url
from tests._support.fetch_servers import RawServer, stored_files, tarpit
from tests._support.file_server import FileServer
from tests._support.image_files import bomb_png, data_uri, encoded, png, truncated
from tests._support.server_fixtures import runpod_jobs, serving, wait_status
from tests._support.toy_models import toy_folder

GREY = np.full((16, 16, 3), 200, np.uint8)
KEEP = np.zeros((16, 16), np.uint8)  # black: keep every pixel
CALL = {"num_inference_steps": 1, "guidance_scale": 1, "seed": 3, "class_label": 0}


@pytest.fixture(scope="module")
def files() -> Iterator[FileServer]:
    server = FileServer().start()
    server.files.update({"/grey.png": png(GREY), "/keep.png": png(KEEP)})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Any]]:
    """(core, base URL, pipe): the toy image model served with a 128² pixel limit, image URLs
    allowed from 127.0.0.1 only."""
    from preheat.server.config import CoreConfig
    from preheat.server.core import Core
    from preheat.server.webhooks import WebhookPolicy

    with pytest.MonkeyPatch.context() as mp:
        pipe = preheat.load(toy_folder(tmp_path_factory.mktemp("toy") / "toy-image", mp), cache="off")
        core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=0, guidance=("off",), max_image_pixels=128 * 128,
                               lora_urls=WebhookPolicy(allow=("127.0.0.1",))), pipe=pipe)
        core.start()
        try:
            assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
            with serving(core) as server:
                yield core, server.url, pipe
        finally:
            core.close()
            set_max_pixels(MAX_IMAGE_PIXELS)


@pytest.fixture()
def client(served) -> Iterator[Any]:
    import httpx

    with httpx.Client(base_url=served[1], timeout=120) as c:
        wait_status(c, "READY")
        yield c


def pixels(response: Any) -> np.ndarray:
    assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text
    return decode_data_url(response.json()["output"][0])


def test_warm_up_compiled_the_image_variants(served) -> None:
    core = served[0]
    assert {sig.variant for sig in core.signatures()} == {(), ("image", "strength"), ("image", "mask_image", "strength")}
    assert any("+image +mask_image" in line for line in core.setup.logs)


def test_cog_takes_images_as_data_uris_and_urls_fetched_once_and_never_stored(served, client, files) -> None:
    core, _, pipe = served
    r = client.post("/predictions", json={"input": {**CALL, "image": data_uri(png(GREY)), "mask": data_uri(png(KEEP))}})
    assert (pixels(r) == 200).all()
    assert r.json()["input"]["mask"].startswith("data:image/png")
    before = len(files.hits)
    r = client.post("/predictions", json={"input": {**CALL, "image": files.url("grey.png"), "mask": files.url("keep.png"),
                                                    "num_outputs": 2}})
    assert (pixels(r) == 200).all() and len(r.json()["output"]) == 2
    assert sorted(h.path for h in files.hits[before:]) == ["/grey.png", "/keep.png"]
    assert stored_files(Path(os.environ["PREHEAT_HOME"])) == set() or all(
        "grey" not in f and "keep" not in f for f in stored_files(Path(os.environ["PREHEAT_HOME"])))
    # strength is data: img2img at 0.5 is halfway between the image and the plain sample
    r = client.post("/predictions", json={"input": {**CALL, "image": files.url("grey.png"), "strength": 0.5}})
    np.testing.assert_array_equal(pixels(r), pipe.generate(1, steps=1, guidance=1.0, seed=3, class_labels=0,
                                                           image=GREY, strength=0.5)[0])
    assert core.batcher.stats["traffic_compiles"] == 0


def test_a_url_outside_the_policy_is_refused_before_any_connection(client) -> None:
    pit = RawServer(tarpit, host="127.0.0.2")  # loopback, but not the allowed 127.0.0.1
    try:
        r = client.post("/predictions", json={"input": {**CALL, "image": pit.url("a.png")}})
        assert r.status_code == 422, r.text
        (error,) = r.json()["detail"]
        assert error["loc"] == ["body", "input", "image"] and "public addresses only" in error["msg"], error
        assert pit.accepted == 0
    finally:
        pit.stop()


@pytest.mark.parametrize("field, value, words", [
    ("image", "/etc/passwd", "http(s) URL or a data: URI"),
    ("image", data_uri(encoded(GREY, "GIF")), "GIF"),
    ("image", data_uri(truncated(png(np.random.default_rng(0).integers(0, 255, (16, 16, 3), np.uint8)))),
     "truncated"),
    ("image", data_uri(bomb_png()), "pixels"),
    ("image", data_uri(png(np.zeros((200, 200, 3), np.uint8))), "16384 pixels"),
    ("image", "data:image/png;base64,@@@", "base64"),
    ("mask", data_uri(png(KEEP[:8])), "same size"),
    ("strength", 0, "greater than 0"),
    ("strength", 1.01, "less than or equal to 1"),
])
def test_bad_images_are_one_line_422s_naming_their_field(client, field: str, value: Any, words: str) -> None:
    body = {**CALL, "image": data_uri(png(GREY)), field: value}
    r = client.post("/predictions", json={"input": body})
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["body", "input", field] and words in error["msg"] and "\n" not in error["msg"], error


def test_a_mask_needs_an_image(client) -> None:
    """The engine's error (``mask_image needs image``) names the mask by the field a client sent."""
    r = client.post("/predictions", json={"input": {**CALL, "mask": data_uri(png(KEEP))}})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "input", "mask"], r.text
    assert r.json()["detail"][0]["msg"] == "mask needs image; give both", r.text


def test_the_openapi_schemas_state_the_image_fields(client) -> None:
    spec = client.get("/openapi.json").json()
    cog = spec["components"]["schemas"]["Input"]["properties"]
    assert cog["image"]["anyOf"][0] == {"type": "string", "format": "uri"}
    assert "repaint (white)" in cog["mask"]["description"]
    assert cog["strength"]["anyOf"][0] == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}
    form = spec["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["properties"]["image"]["format"] == "binary" and "strength" in form["properties"]
    assert "alpha 0" in form["properties"]["mask"]["description"]


def _rgba(alpha: int) -> bytes:
    return encoded(np.dstack([np.full((16, 16, 3), 50, np.uint8), np.full((16, 16), alpha, np.uint8)]), "PNG", "RGBA")


def test_openai_edits_map_transparent_to_repaint(served, client) -> None:
    _, _, pipe = served
    form = {"prompt": "0", "n": "1", "seed": "3", "num_inference_steps": "1", "guidance_scale": "1", "strength": "1"}
    image = ("image", ("grey.png", png(GREY), "image/png"))

    def b64(r: Any) -> np.ndarray:
        assert r.status_code == 200, r.text
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))

    opaque = client.post("/v1/images/edits", data=form, files=[image, ("mask", ("m.png", _rgba(255), "image/png"))])
    assert (b64(opaque) == 200).all()  # no transparent pixel: keep everything
    clear = client.post("/v1/images/edits", data=form, files=[image, ("mask", ("m.png", _rgba(0), "image/png"))])
    plain = pipe.generate(1, steps=1, guidance=1.0, seed=3, class_labels=0)[0]
    np.testing.assert_array_equal(b64(clear), plain[..., 0])  # all transparent, strength 1: all repainted
    # no mask: an image with transparent pixels is its own mask (dall-e-2's reading)
    own = client.post("/v1/images/edits", data=form, files=[("image", ("i.png", _rgba(0), "image/png"))])
    np.testing.assert_array_equal(b64(own), plain[..., 0])

    for files, field in [([image, ("mask", ("m.png", png(KEEP), "image/png"))], "mask"),  # no alpha at all
                         ([("mask", ("m.png", _rgba(0), "image/png"))], "image"),
                         ([("image", ("i.gif", encoded(GREY, "GIF"), "image/gif"))], "image")]:
        r = client.post("/v1/images/edits", data=form, files=files)
        assert r.status_code == 422 and r.json()["error"]["param"] == field, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/images/edits", data={**form, "strength": "0"}, files=[image])
    assert r.status_code == 422 and r.json()["error"]["param"] == "strength", r.text
    r = client.post("/v1/images/edits", data={**form, "response_format": "url"}, files=[image])
    assert r.status_code == 422 and r.json()["error"]["param"] == "response_format", r.text
    r = client.post("/v1/images/edits", json={"prompt": "0"})
    assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]["message"], r.text


def test_runpod_takes_image_fields(served, files) -> None:
    core = served[0]
    ok, bad = runpod_jobs(core, {"input": {**CALL, "image": files.url("grey.png"), "mask": data_uri(png(KEEP))}},
                          {"input": {**CALL, "image": data_uri(bomb_png())}})
    assert (decode_data_url(ok["images"][0]) == 200).all(), ok
    assert bad["error"].startswith("image:") and "\n" not in bad["error"], bad
