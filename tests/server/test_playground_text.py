"""The playground page in a real browser on a text-to-image model with image inputs: a tiny SD 1.x
folder served on 127.0.0.1 (no token). A person types a prompt, uploads a picture, draws a mask on
it and runs: the page streams the steps to N/N and shows the inpainted image at the served size,
and the server drew exactly what the engine draws for the same request.

(tests/server/test_playground.py covers the page's other behaviour on the built-in class model.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from preheat.server.core import CoreConfig
from tests._support.browser import chromium, visible_text, wait_for
from tests._support.server_fixtures import started_server

STEPS = 3


@pytest.fixture(scope="module")
def sd_pipe(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import preheat
    from tests._support.sd_fixtures import save_tiny_sd

    return preheat.load(save_tiny_sd(tmp_path_factory.mktemp("playground-sd") / "sd1", kind="sd1"), cache="off")


@pytest.fixture(scope="module")
def server(sd_pipe: Any):
    # one bucket, guided (the model's default, what the page sends): the programs a run here can reach
    with started_server(CoreConfig(max_batch_size=1, batch_wait_ms=0, max_steps=10, guidance=("on",)), sd_pipe) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


@pytest.mark.slow  # a tiny SD server warms every guided image variant: about a minute on 2 cores
def test_a_prompt_an_upload_and_a_drawn_mask_run_to_an_image(browser: Any, server: Any, sd_pipe: Any,
                                                             tmp_path: Path) -> None:
    import base64
    import io

    from PIL import Image
    from selenium.webdriver.common.action_chains import ActionChains

    from preheat.server.images import decode_data_url

    browser.get(server.url + "/playground")
    wait_for(browser, lambda d: visible_text(d, "status") == "READY", "READY")
    prompt = wait_for(browser, lambda d: d.find_element("id", "f-prompt"), "the prompt box")
    ids = browser.execute_script("return [...document.querySelectorAll('#fields [id^=f-]')].map(e => e.id)")
    assert {"f-prompt", "f-negative_prompt", "f-image", "f-strength"} <= set(ids), ids
    assert "f-class_label" not in ids  # a text model's form has no class box

    prompt.send_keys("a red fox in the snow")
    picture = tmp_path / "in.png"
    Image.fromarray(np.random.RandomState(0).randint(0, 256, (32, 32, 3), dtype=np.uint8)).save(picture)
    browser.find_element("id", "f-image").send_keys(str(picture))
    mask_name = next(i for i in ids if i.startswith("f-mask") and not i.endswith(("-canvas", "-preview")))[2:]
    canvas = wait_for(browser, lambda d: d.find_element("id", f"f-{mask_name}-canvas"), "the mask canvas")
    ActionChains(browser).move_to_element(canvas).click_and_hold().move_by_offset(8, 0).release().perform()
    steps = browser.find_element("id", "f-num_inference_steps")
    steps.clear()
    steps.send_keys(str(STEPS))
    seed = browser.find_element("id", "f-seed")
    seed.clear()
    seed.send_keys("4")
    sent = browser.execute_script("return collect()")
    browser.find_element("id", "run").click()

    wait_for(browser, lambda d: visible_text(d, "progress-text").endswith(f"/{STEPS}")
             and visible_text(d, "progress-text").split("/")[0] == visible_text(d, "progress-text").split("/")[1],
             "progress to N/N")
    src = wait_for(browser, lambda d: d.execute_script(
        "const im = document.querySelector('.run figure img');"
        "return im && im.complete && im.naturalWidth === 32 && im.naturalHeight === 32 ? im.src : null"),
        "a 32x32 image")
    assert browser.find_element("css selector", ".run .state").text == "succeeded"
    assert "a red fox in the snow" in browser.find_element("css selector", ".run .echo").text

    # the server drew what the engine draws for the request the page sent (the same bucket: bit-exact)
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(sent["image"].partition(",")[2]))).convert("RGB"))
    mask = np.asarray(Image.open(io.BytesIO(base64.b64decode(sent[mask_name].partition(",")[2]))).convert("L"))
    assert mask.shape == (32, 32) and mask.max() == 255 and mask.min() == 0  # the stroke, white on black
    given = {"strength": float(sent["strength"])} if sent.get("strength") not in (None, "") else {}  # else the default
    want = sd_pipe.generate("a red fox in the snow", image=image, mask_image=mask, steps=STEPS, seed=4, **given)[0]
    np.testing.assert_array_equal(decode_data_url(src), want)


@pytest.mark.slow  # a second server: the built-in text model's guided programs (16x16: seconds)
@pytest.mark.skipif(not (Path(__file__).parents[2] / "src/preheat/assets/text_digits/model_index.json").is_file(),
                    reason="builtin:text-digits is not shipped")
def test_the_built_in_text_model_has_a_prompt_box_that_draws_the_digit(browser: Any) -> None:
    """Offline, with no folder of one's own: `preheat serve builtin:text-digits` and its page. A
    prompt typed in the box reaches the image the engine draws for it."""
    import preheat
    from preheat.server.images import decode_data_url

    pipe = preheat.load("builtin:text-digits", cache="off")
    config = CoreConfig(max_batch_size=1, batch_wait_ms=0, max_steps=10, guidance=("on",))
    with started_server(config, pipe) as srv:
        browser.get(srv.url + "/playground")
        wait_for(browser, lambda d: visible_text(d, "status") == "READY", "READY")
        prompt = wait_for(browser, lambda d: d.find_element("id", "f-prompt"), "the prompt box")
        prompt.send_keys("a bold seven")
        for field, value in (("f-num_inference_steps", str(STEPS)), ("f-seed", "4")):
            box = browser.find_element("id", field)
            box.clear()
            box.send_keys(value)
        browser.find_element("id", "run").click()
        src = wait_for(browser, lambda d: d.execute_script(
            "const im = document.querySelector('.run figure img');"
            "return im && im.complete && im.naturalWidth === 16 ? im.src : null"), "a 16x16 image")
        assert browser.find_element("css selector", ".run .state").text == "succeeded"
    np.testing.assert_array_equal(decode_data_url(src), pipe.generate("a bold seven", steps=STEPS, seed=4)[0])
