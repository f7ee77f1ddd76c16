"""The playground page in a real browser (headless Chromium, selenium) against a real server on
127.0.0.1 serving the tiny digits-shaped model, with a token.

One server and one browser for the module. The server's set-up is held until the page has shown
``STARTING`` (a loader that waits on an event), so that the first page load sees the warm-up.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from preheat.server.core import Core, CoreConfig
from tests._support.browser import chromium, visible_text, wait_for
from tests._support.file_server import FileServer
from tests._support.server_fixtures import serving

TOKEN = "s3cret-token"
STEPS = 4


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("loras")
    (base / "styles").mkdir()
    (base / "styles" / "ink.safetensors").write_bytes(b"not read by these tests")
    return base


@pytest.fixture(scope="module")
def gate() -> threading.Event:
    return threading.Event()


@pytest.fixture(scope="module")
def core(pipe: Any, gate: threading.Event, lora_dir: Path):
    def held(config: CoreConfig) -> Any:  # set-up waits until the page has seen STARTING
        assert gate.wait(120)
        return pipe

    # guidance on only: the model's default (2.0), what every run here uses; fewer programs to warm
    core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=0, max_queue=16, max_steps=20, guidance=("on",),
                           lora_dir=str(lora_dir)), loader=held).start()
    yield core
    gate.set()
    core.close()


@pytest.fixture(scope="module")
def server(core: Core):
    with serving(core, token=TOKEN) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


@pytest.fixture(scope="module")
def first_load(browser: Any, server: Any, core: Core, gate: threading.Event) -> dict[str, Any]:
    """What the page showed on the server's first minutes: opened at ``/`` while set-up is held,
    then set-up released. Returns what was seen; the page is left at its token prompt."""
    browser.get(server.url + "/")
    seen: dict[str, Any] = {"url": browser.current_url}
    seen["starting"] = wait_for(browser, lambda d: visible_text(d, "status") == "STARTING" and "STARTING",
                                "the STARTING badge")
    seen["form_while_starting"] = visible_text(browser, "form")
    seen["token_form_while_starting"] = visible_text(browser, "token-form")
    gate.set()
    assert core.wait_setup(300) and core.setup.status == "succeeded", core.setup.logs
    wait_for(browser, lambda d: visible_text(d, "token-form"), "the token prompt once READY")
    seen["status_after"] = visible_text(browser, "status")
    return seen


def open_page(browser: Any, server: Any, first_load: dict[str, Any]) -> None:
    """A fresh page (the token is forgotten on reload), the token given, the form shown."""
    browser.get(server.url + "/playground")
    wait_for(browser, lambda d: visible_text(d, "token-form"), "the token prompt")
    browser.find_element("id", "token").send_keys(TOKEN)
    browser.find_element("css selector", "#token-form button").click()
    wait_for(browser, lambda d: d.find_element("id", "f-class_label").is_displayed(), "the form")


def run(browser: Any, **fields: str) -> None:
    for name, value in fields.items():
        box = browser.find_element("id", f"f-{name}")
        box.clear()
        box.send_keys(value)
    browser.find_element("id", "run").click()


def test_starting_until_ready_then_the_token_prompt(browser: Any, server: Any, first_load: dict[str, Any]) -> None:
    assert first_load["url"].endswith("/playground")  # / redirects to the page
    assert first_load["starting"] == "STARTING"
    assert first_load["form_while_starting"] == "" and first_load["token_form_while_starting"] == ""
    assert first_load["status_after"] == "READY"
    # a fresh page (the tests run in any order; the token is forgotten on reload): a wrong token is
    # refused and asked again; the right one builds the form
    browser.get(server.url + "/playground")
    wait_for(browser, lambda d: visible_text(d, "token-form"), "the token prompt")
    browser.find_element("id", "token").send_keys("wrong")
    browser.find_element("css selector", "#token-form button").click()
    wait_for(browser, lambda d: "refused" in visible_text(d, "token-error"), "the refused-token message")
    browser.find_element("id", "token").send_keys(TOKEN)
    browser.find_element("css selector", "#token-form button").click()
    wait_for(browser, lambda d: d.find_element("id", "f-class_label").is_displayed(), "the form")
    storage = browser.execute_script("return [localStorage.length, sessionStorage.length, document.cookie]")
    assert storage == [0, 0, ""]  # the token lives in the page's memory only
    # the page itself needs no token; the API still does
    assert httpx.get(server.url + "/playground").status_code == 200
    assert httpx.get(server.url + "/openapi.json").status_code == 401


def test_the_form_comes_from_the_declared_inputs(browser: Any, server: Any, first_load: dict[str, Any]) -> None:
    open_page(browser, server, first_load)
    ids = browser.execute_script("return [...document.querySelectorAll('#fields [id^=f-]')].map(e => e.id)")
    assert {"f-class_label", "f-size", "f-num_outputs", "f-num_inference_steps", "f-guidance_scale",
            "f-scheduler", "f-seed", "f-lora_weights", "f-lora_scale"} <= set(ids)
    assert "f-prompt" not in ids and "f-width" not in ids  # an alias of class_label; the size select says both
    sizes = browser.execute_script("return [...document.querySelectorAll('#f-size option')].map(o => o.value)")
    assert sizes == ["16x16"]
    classes = browser.execute_script(
        "return [...document.querySelectorAll('#f-class_label-names option')].map(o => o.value)")
    assert classes == [str(i) for i in range(10)]
    loras = browser.execute_script(
        "return [...document.querySelectorAll('#f-lora_weights-examples option')].map(o => o.value)")
    assert loras == [os.path.join("styles", "ink.safetensors")]
    steps = browser.find_element("id", "f-num_inference_steps")
    assert (steps.get_attribute("min"), steps.get_attribute("max")) == ("1", "20")


def test_a_run_streams_progress_to_n_of_n_and_shows_the_images(browser: Any, server: Any,
                                                               first_load: dict[str, Any], tmp_path: Path) -> None:
    open_page(browser, server, first_load)
    run(browser, class_label="7", num_inference_steps=str(STEPS), num_outputs="2")
    wait_for(browser, lambda d: visible_text(d, "progress-text") == f"{STEPS}/{STEPS}", f"progress {STEPS}/{STEPS}")
    sizes = wait_for(browser, lambda d: d.execute_script(
        "const ims = [...document.querySelectorAll('.run figure img')];"
        "return ims.length === 2 && ims.every(i => i.complete && i.naturalWidth)"
        " ? ims.map(i => [i.naturalWidth, i.naturalHeight]) : null"), "two images")
    assert sizes == [[16, 16], [16, 16]]
    assert "class_label: 7" in browser.find_element("css selector", ".run .echo").text
    assert browser.find_element("css selector", ".run .state").text == "succeeded"
    assert "predict_time" in browser.find_element("css selector", ".run .timings").text
    shot = tmp_path / "playground.png"
    assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("PREHEAT_PLAYGROUND_SCREENSHOT"):  # docs/serving.md's picture: docs/playground.png
        shutil.copyfile(shot, os.environ["PREHEAT_PLAYGROUND_SCREENSHOT"])


def test_a_script_in_the_prompt_is_shown_not_run(browser: Any, server: Any, first_load: dict[str, Any]) -> None:
    open_page(browser, server, first_load)
    evil = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'
    run(browser, class_label=evil)
    error = wait_for(browser, lambda d: d.find_element("css selector", ".run .error").text, "the error message")
    assert evil in error  # the server's message echoes the input: shown as text
    assert evil in browser.find_element("css selector", ".run .echo").text
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.execute_script("return document.querySelectorAll('.run img, .run script').length") == 0


def test_the_page_cannot_make_the_server_fetch_a_refused_url(browser: Any, server: Any,
                                                             first_load: dict[str, Any]) -> None:
    files = FileServer().start()
    try:
        files.files["/x.safetensors"] = b"0" * 64
        open_page(browser, server, first_load)
        run(browser, lora_weights=files.url("x.safetensors"))
        error = wait_for(browser, lambda d: d.find_element("css selector", ".run .error").text, "the error message")
        assert "lora_weights" in error and "127.0.0.1" in error
        assert files.hits == []  # the policy refused it before any request
    finally:
        files.stop()


def test_image_inputs_get_an_upload_and_a_drawn_mask(browser: Any, server: Any, first_load: dict[str, Any],
                                                     tmp_path: Path) -> None:
    """The image fields come from the schema's type (``format: uri``; a mask names its image with
    ``x-mask-of``): a schema with them builds an upload and a mask canvas over the uploaded image."""
    from PIL import Image

    open_page(browser, server, first_load)
    picture = tmp_path / "in.png"
    Image.new("RGB", (40, 24), (200, 30, 30)).save(picture)
    browser.execute_script("""
        const spec = JSON.parse(JSON.stringify(S.spec));
        Object.assign(spec.components.schemas.Input.properties, {
          image: {anyOf: [{type: "string", format: "uri"}, {type: "null"}], title: "Image", "x-order": 3},
          mask_image: {anyOf: [{type: "string", format: "uri"}, {type: "null"}], title: "Mask",
                       "x-order": 4, "x-mask-of": "image"}});
        buildForm(spec);""")
    browser.find_element("id", "f-image").send_keys(str(picture))
    canvas = wait_for(browser, lambda d: d.find_element("id", "f-mask_image-canvas"), "the mask canvas")
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).move_to_element(canvas).click_and_hold().move_by_offset(10, 0).release().perform()
    sent = browser.execute_script("return collect()")
    assert sent["image"].startswith("data:image/png;base64,")
    mask = Image.open(io.BytesIO(base64.b64decode(sent["mask_image"].partition(",")[2]))).convert("L")
    assert mask.size == (40, 24)
    assert mask.getextrema() == (0, 255)  # black, with the drawn stroke white
