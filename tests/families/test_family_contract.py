"""The family contract: every family's declared inputs reach every surface, with one meaning.

Like the sampler contract suite (``tests/samplers/``), this runs the same checks on every family
-- pixel (the built-in model), SD 1.x, SDXL, SD3, Flux -- through every surface: the Python call,
``preheat sample``, Cog's ``POST /predictions`` and OpenAI's ``/v1/images/generations`` over real
HTTP on 127.0.0.1, and the Runpod handler. For each declared input (``Family.input_specs``):

* its default is accepted, and the image equals the Python call's;
* a value out of its declared bounds is refused: a one-line ``InvalidArgumentError`` naming it
  (Python), exit 2 naming its flag (CLI), a 422 naming its field (Cog, OpenAI), an error naming
  it (Runpod) -- each surface's message names it by that surface's name, never by the engine's
  keyword where the two differ (``class_labels=`` is no field of a server's).

The bad values come from the specs themselves (:func:`out_of_bounds`), so a new input is covered
by its declaration. One compile per family: every accepted call is the program the server warmed
(batch 1, guidance off, the native size; steps are data).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import preheat
from preheat.errors import InvalidArgumentError
from preheat.families.inputs import (COMMON_SPECS, IMAGE_SIZE, Choice, Float, Image, InputSpec, Int, Ints, Label, Pair,
                                    Text)
from preheat.families.offer import optional_inputs
from preheat.server.images import decode_data_url
from tests._support.image_files import data_uri, encoded
from tests._support.server_fixtures import runpod_jobs, serving, wait_status

KINDS = ("pixel", "sd1", "sdxl", "sd3", "flux-dev")
CHEAP = {"steps": 1, "guidance": 1.0, "seed": 3}  # the warmed program: guidance off (1 = off everywhere)
COG_CHEAP = {"num_inference_steps": 1, "guidance_scale": 1.0, "seed": 3}


def out_of_bounds(spec: InputSpec) -> Any:
    """A value the spec's own bounds refuse (one value for all images, as every surface takes)."""
    t = spec.type
    if isinstance(t, Text):
        return "x" * (t.max_length + 1)
    if isinstance(t, Int):
        return (t.high + t.multiple) if t.high is not None else t.low - 1
    if isinstance(t, Float):
        return (t.high + 1.0) if t.high is not None else t.low - 1.0
    if isinstance(t, Choice):
        return "not-" + "-".join(t.options)
    if isinstance(t, Pair):
        return [t.low - 1, t.low - 1]
    if isinstance(t, Ints):
        return [t.low - 1]
    if isinstance(t, Label):
        return t.count if t.count is not None else 0
    if isinstance(t, Image):  # a format no surface takes, as a data URI (a server's, and read_image's)
        return data_uri(encoded(np.zeros((8, 8, 3), np.uint8), "GIF"))
    raise AssertionError(f"no out-of-bounds value for {type(t).__name__}")


def accepted_inputs(pipe: Any) -> dict[str, Any]:
    """The family's inputs at their defaults: required ones get their first warm value."""
    return {s.name: s.warm[0] for s in pipe.family.input_specs(pipe) if s.required}


def _folder(kind: str, root: Path) -> Path | None:
    if kind == "pixel":
        return None  # the built-in digits model
    if kind.startswith("sd") and kind != "sd3":
        from tests._support.sd_fixtures import save_tiny_sd

        return save_tiny_sd(root / kind, kind)
    from tests._support.flow_fixtures import save_tiny_flow_model

    return save_tiny_flow_model(root / kind, kind)


def _drawn_small(pipe: Any) -> Any:
    """FLUX.1's native size is diffusers' ``default_sample_size``, 128 latents a side whatever the
    folder: 256x256 with the tiny folder's 2x VAE, 64 times the pixels of the other families' 32x32,
    and every call here (the server's warm-up, each surface's default) draws it. The contract is
    about the declared inputs, not the size, so the module's FLUX pipeline takes 16x16 latents as its
    own default (``sample_shape``, the one field ``native_size`` reads): every surface derives its
    default size from the family, so each still draws "the native size", at 32x32."""
    import dataclasses

    assert pipe.family.native_size(pipe) == (256, 256)  # the real one, as loaded
    small = dataclasses.replace(pipe, sample_shape=(16, 16, *pipe.sample_shape[2:]))
    assert small.family.native_size(small) == (32, 32)
    return small


@pytest.fixture(scope="module", params=KINDS)
def served(request, tmp_path_factory):
    """(kind, folder, pipe, core, base url): one family, its warmed server, for the whole module."""
    import httpx

    from preheat.server.config import CoreConfig
    from preheat.server.core import Core

    kind = request.param
    folder = _folder(kind, tmp_path_factory.mktemp(f"contract-{kind}"))
    pipe = preheat.load(folder, cache="off")
    if kind == "flux-dev":
        pipe = _drawn_small(pipe)
    # every optional input offered, those a server offers only when told included (FLUX.1's negative
    # prompt): each declared input is then checked on every surface; unguided, none adds a program here
    offered = optional_inputs(_specs(pipe))
    core = Core(CoreConfig(max_batch_size=1, batch_wait_ms=0, max_steps=50, guidance=("off",), inputs=offered),
                pipe=pipe)
    core.start()
    try:
        assert core.wait_setup(900) and core.setup.status == "succeeded", core.setup.logs
        with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
            wait_status(client, "READY")
            yield kind, folder, pipe, core, client
    finally:
        core.close()


def _specs(pipe: Any) -> tuple[InputSpec, ...]:
    return tuple(pipe.family.input_specs(pipe))


def engine_named(specs: tuple[InputSpec, ...], message: str, surface: str = "server") -> list[str]:
    """The engine keywords ``message`` names inputs by (``class_labels=3``, ``prompt has 2001
    characters``, ``sampler 'ddim'``) where ``surface`` ("server": its fields; "cli": its flags) names
    them otherwise: of the family's inputs ``specs`` and the common ones (``steps``, ``sampler``, ...)."""
    used = []
    for spec in (*specs, *COMMON_SPECS):
        own = spec.cli_flag if surface == "cli" else spec.surface_name
        # the keyword given a value, or the subject of the sentence; never inside a word or a flag
        if own != spec.name and re.search(rf"(?<![\w-]){re.escape(spec.name)}(?:=| (?:has|must|given|is|needs|"
                                          rf"['\"\[(]))", message):
            used.append(spec.name)
    return used


def test_the_engine_keyword_check_sees_each_way_a_message_names_an_input() -> None:
    """A message from before each surface words it in its own names is caught (it names the engine's
    keyword), and the reworded one is not."""
    prompt = InputSpec("prompt", Text(), "A prompt.")
    labels = InputSpec("class_labels", Label(10), "A class.", field="class_label", flag="--class")
    assert engine_named((prompt,), "--prompt: prompt has 2001 characters; at most 2000", "cli") == ["prompt"]
    assert engine_named((prompt,), "--prompt has 2001 characters; at most 2000", "cli") == []
    assert engine_named((labels,), "class_labels=10 is unknown", "server") == ["class_labels"]
    assert engine_named((), "timesteps is not supported for sampler 'ddim'", "server") == ["sampler"]
    assert engine_named((), "timesteps is not supported for scheduler 'ddim'", "server") == []
    assert engine_named((), "strength=0.1 with steps=2 runs no step", "server") == ["steps"]
    assert engine_named((), "strength=0.1 with num_inference_steps=2 runs no step", "server") == []
    assert engine_named((), "--strength=0.1 with --steps=2 runs no step", "cli") == []


def _cog(spec: InputSpec, value: Any) -> dict[str, Any]:
    return {spec.surface_name: value}


def test_every_declared_default_is_accepted_on_every_surface(served, monkeypatch, tmp_path):
    from click.testing import CliRunner

    from preheat.cli import main

    kind, folder, pipe, core, client = served
    inputs = accepted_inputs(pipe)
    want = pipe.generate(1, **CHEAP, **inputs)  # Python: the reference image

    cog = {s.surface_name: v for s, v in ((s, inputs[s.name]) for s in _specs(pipe) if s.name in inputs)}
    r = client.post("/predictions", json={"input": {**cog, **COG_CHEAP}})
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    np.testing.assert_array_equal(decode_data_url(r.json()["output"][0]), want[0])

    body = {"n": 1, "seed": 3, "num_inference_steps": 1, "guidance_scale": 1.0,
            **({"prompt": inputs["prompt"]} if "prompt" in inputs else {})}
    r = client.post("/v1/images/generations", json=body)
    assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text

    (result,) = runpod_jobs(core, {"id": kind, "input": {**cog, **COG_CHEAP}})
    assert "error" not in result, result
    np.testing.assert_array_equal(decode_data_url(result["images"][0]), want[0])

    # the CLI, on the pipeline already loaded (the family compiles once per session)
    monkeypatch.setattr(preheat, "load", lambda *a, **k: pipe)
    flags = [x for s in _specs(pipe) if s.name in inputs for x in (s.cli_flag, str(inputs[s.name]))]
    out = tmp_path / "a.png"
    result = CliRunner().invoke(main, ["sample", *([str(folder)] if folder else []), "--n", "1", "--steps", "1",
                                       "--guidance", "1", "--seed", "3", *flags, "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert out.is_file()


def test_every_declared_input_out_of_bounds_is_refused_naming_it(served, monkeypatch, tmp_path):
    from click.testing import CliRunner

    from preheat.cli import main

    kind, folder, pipe, core, client = served
    base = accepted_inputs(pipe)
    monkeypatch.setattr(preheat, "load", lambda *a, **k: pipe)
    for spec in _specs(pipe):
        bad = out_of_bounds(spec)
        # Python
        with pytest.raises(InvalidArgumentError) as err:
            pipe.check(1, **CHEAP, **{**base, spec.name: bad})
        assert err.value.argument == spec.name and len(str(err.value).splitlines()) == 1, (spec.name, err.value)
        # Cog over HTTP
        r = client.post("/predictions", json={"input": {**{s.surface_name: base[s.name] for s in _specs(pipe)
                                                            if s.name in base}, **COG_CHEAP, **_cog(spec, bad)}})
        assert r.status_code == 422, (spec.name, r.text)
        assert any(spec.surface_name in e["loc"] for e in r.json()["detail"]), (spec.name, r.json())
        assert not any(engine_named(_specs(pipe), e["msg"]) for e in r.json()["detail"]), (spec.name, r.json())
        # Runpod
        (result,) = runpod_jobs(core, {"id": kind, "input": {**{s.surface_name: base[s.name] for s in _specs(pipe)
                                                                  if s.name in base}, **_cog(spec, bad)}})
        assert result.get("error", "").startswith(f"{spec.surface_name}: "), (spec.name, result)
        assert not engine_named(_specs(pipe), result["error"]), (spec.name, result)
        # OpenAI over HTTP (a size is OpenAI's "size"; every other input an extra field)
        body: dict[str, Any] = {"n": 1, **({"prompt": base["prompt"]} if "prompt" in base else {})}
        if spec.name in IMAGE_SIZE:  # the native size with this side out of bounds
            size = {**IMAGE_SIZE.inputs(pipe.family.native_size(pipe)), spec.name: bad}
            body["size"] = "x".join(str(size[side]) for side in IMAGE_SIZE)
            param = "size"
        else:
            body[spec.surface_name] = bad
            param = spec.surface_name
        r = client.post("/v1/images/generations", json=body)
        assert r.status_code == 422 and r.json()["error"]["param"] == param, (spec.name, r.text)
        assert not engine_named(_specs(pipe), r.json()["error"]["message"]), (spec.name, r.text)
        # the CLI
        value = ",".join(map(str, bad)) if isinstance(bad, list) else str(bad)
        others = [x for s in _specs(pipe) if s.name in base and s.name != spec.name
                  for x in (s.cli_flag, str(base[s.name]))]
        result = CliRunner().invoke(main, ["sample", *([str(folder)] if folder else []), "--n", "1", "--steps", "1",
                                           *others, f"{spec.cli_flag}={value}", "--out", str(tmp_path / "b.png")])
        assert result.exit_code == 2, (spec.name, result.output)
        assert len(result.output.strip().splitlines()) == 1 and spec.cli_flag in result.output, (
            spec.name, result.output)
        assert not engine_named(_specs(pipe), result.output, "cli"), (spec.name, result.output)


def test_the_schemas_state_every_declared_input(served):
    kind, folder, pipe, core, client = served
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    cog, openai = schema["Input"]["properties"], schema["ImageGenerationRequest"]["properties"]
    for spec in _specs(pipe):
        assert spec.surface_name in cog, (spec.name, sorted(cog))
        if spec.name not in IMAGE_SIZE:  # OpenAI's size states both
            assert spec.surface_name in openai, (spec.name, sorted(openai))
    assert schema["Input"]["additionalProperties"] is False


def test_the_folder_configs_declare_what_the_loaded_model_requires(served):
    """A process that reads no weight (a bench's parent) types flags and fills required inputs from
    ``declared_family(folder).folder_specs(folder)``: the same family, and each of its inputs as
    required as the loaded model's own declaration says."""
    from preheat.engine import BUILTIN_MODEL
    from preheat.families import declared_family

    kind, folder, pipe, core, client = served
    root = BUILTIN_MODEL if folder is None else folder
    family = declared_family(root)
    assert family is not None and family.name == pipe.family.name
    loaded = {s.name: s.required for s in _specs(pipe)}
    assert {s.name: s.required for s in family.folder_specs(root)} == \
        {name: loaded[name] for name in (s.name for s in family.specs)}
