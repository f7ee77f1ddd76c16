"""A new family input is a declaration alone (issue 26): the toy family of ``family.py`` adds
``brightness`` in this folder only, and every surface takes it.

    Python API      pipe.generate(brightness=0.5) changes the image; 2.0 is refused naming it
    CLI             preheat sample --help lists --brightness; --brightness 0.5 reaches the call
    Cog, OpenAI     the OpenAPI schemas state it (bounds, description); a request with it runs
    warm-up         the warm set compiles both of its declared warm values
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import preheat
from preheat.engine import BUILTIN_MODEL
from preheat.errors import InvalidArgumentError
from preheat.server.images import decode_data_url
from tests._support.server_fixtures import serving, wait_status


@pytest.fixture()
def toy(tmp_path, monkeypatch) -> Path:
    """The built-in model's folder as a ``ToyPipeline``, the class registered for this test."""
    import preheat.families as families

    monkeypatch.setitem(families.FAMILY_OF_CLASS, "ToyPipeline", ("tests.families.toy.family", "load_toy"))
    folder = tmp_path / "toy"
    shutil.copytree(BUILTIN_MODEL, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "ToyPipeline"}))
    return folder


def test_a_new_input_reaches_every_surface(toy, tmp_path):
    import httpx
    from click.testing import CliRunner

    from preheat.warm import WarmSet, resolve, signatures
    from preheat.cli import main
    from preheat.server.config import CoreConfig
    from preheat.server.core import Core

    pipe = preheat.load(toy, cache="off")
    assert pipe.family.name == "toy" and "brightness" in pipe.family.inputs
    # Python: data (same program), a real effect, and its bounds
    plain = pipe.generate(1, steps=1, guidance=1.0, seed=3)
    lifted = pipe.generate(1, steps=1, guidance=1.0, seed=3, brightness=0.5)
    assert lifted.mean() > plain.mean()
    with pytest.raises(InvalidArgumentError) as err:
        pipe.check(1, brightness=2.0)
    assert err.value.argument == "brightness" and "\n" not in str(err.value)

    # warm-up: each declared warm value is a variant the set compiles
    sigs = signatures(pipe, resolve(pipe, WarmSet(max_batch_size=1, guidance=("off",))))
    assert sorted(dict(s.given)["brightness"] for s in sigs) == [0.0, 0.5]

    # the CLI: listed in --help, and passed to the call
    help_text = CliRunner().invoke(main, ["sample", "--help"]).output
    assert "--brightness" in help_text and "How much to lift" in help_text
    out = tmp_path / "a.png"
    result = CliRunner().invoke(main, ["sample", str(toy), "--n", "1", "--steps", "1", "--guidance", "1",
                                       "--seed", "3", "--brightness", "0.5", "--cache", "off", "--out", str(out),
                                       "--quiet", "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(main, ["sample", str(toy), "--brightness", "2", "--cache", "off",
                                    "--out", str(tmp_path / "b.png")])
    assert bad.exit_code == 2 and "--brightness" in bad.output, bad.output

    # Cog and OpenAI: in both schemas, and served
    core = Core(CoreConfig(max_batch_size=1, batch_wait_ms=0, guidance=("off",)), pipe=pipe)
    core.start()
    try:
        assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
        with serving(core) as server, httpx.Client(base_url=server.url, timeout=120) as client:
            wait_status(client, "READY")
            schemas = client.get("/openapi.json").json()["components"]["schemas"]
            cog = schemas["Input"]["properties"]["brightness"]
            assert cog["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 1.0} and cog["default"] == 0.0
            assert "brightness" in schemas["ImageGenerationRequest"]["properties"]
            r = client.post("/predictions", json={"input": {"brightness": 0.5, "num_inference_steps": 1,
                                                            "guidance_scale": 1, "seed": 3, "class_label": 0}})
            assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
            np.testing.assert_array_equal(decode_data_url(r.json()["output"][0]),
                                          pipe.generate(1, steps=1, guidance=1.0, seed=3, class_labels=0,
                                                        brightness=0.5)[0])
            r = client.post("/v1/images/generations", json={"prompt": "0", "brightness": 0.5, "seed": 3,
                                                             "num_inference_steps": 1, "guidance_scale": 1})
            assert r.status_code == 200, r.text
            r = client.post("/predictions", json={"input": {"brightness": 2}})
            assert r.status_code == 422 and any("brightness" in e["loc"] for e in r.json()["detail"]), r.text
    finally:
        core.close()
