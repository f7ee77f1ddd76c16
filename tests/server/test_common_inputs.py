"""The common inputs (``COMMON_SPECS``) on every surface, derived from their declarations: ``eta``
over Cog's route, the OpenAI route, the Runpod handler and the CLI draws what the Python call's
``eta=`` draws; custom ``timesteps`` without a step count use their count everywhere, and a
different count is one line naming both. Real HTTP on 127.0.0.1, on the session's tiny
class-conditional pixel model (which declares ``timesteps``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest

from preheat.families.inputs import COMMON_SPECS, common_spec
from preheat.server.core import Core, CoreConfig
from preheat.server.images import decode_data_url
from tests._support.server_fixtures import runpod_jobs, serving, wait_status

MAX_STEPS = 30
CALL = dict(class_labels=3, steps=3, seed=4)  # the Python call
BODY = {"class_label": 3, "num_inference_steps": 3, "seed": 4}  # the same, as a server's input fields


@pytest.fixture(scope="module")
def core(pipe: Any) -> Iterator[Core]:
    config = CoreConfig(max_batch_size=1, batch_wait_ms=0, max_steps=MAX_STEPS, samplers=("ddim", "tcd"),
                        guidance=("on",))
    core = Core(config, pipe=pipe).start()
    assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
    yield core
    core.close()


@pytest.fixture(scope="module")
def client(core: Core) -> Iterator[httpx.Client]:
    with serving(core) as server, httpx.Client(base_url=server.url, timeout=300) as client:
        wait_status(client, "READY")
        yield client


def predicted(client: httpx.Client, inputs: dict) -> np.ndarray:
    r = client.post("/predictions", json={"input": inputs})
    assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    (url,) = r.json()["output"]
    return decode_data_url(url)


def one_error(r: httpx.Response) -> dict:
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert "\n" not in error["msg"], error
    return error


@pytest.mark.parametrize("sampler", ["ddim", "tcd"])
def test_eta_over_every_surface_draws_what_python_draws(client: httpx.Client, core: Core, pipe: Any,
                                                        sampler: str) -> None:
    want = pipe.generate(1, sampler=sampler, eta=0.7, **CALL)
    plain = pipe.generate(1, sampler=sampler, **CALL)
    assert np.abs(want.astype(int) - plain).mean() > 1  # eta (DDIM's eta, TCD's gamma) changes the image
    body = {**BODY, "scheduler": sampler}
    np.testing.assert_array_equal(predicted(client, {**body, "eta": 0.7}), want[0])  # one bucket: bit-exact
    np.testing.assert_array_equal(predicted(client, body), plain[0])  # absent: 0, as in Python

    r = client.post("/v1/images/generations", json={"prompt": "3", "n": 1, "seed": 4, "scheduler": sampler,
                                                    "num_inference_steps": 3, "eta": 0.7})
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    np.testing.assert_array_equal(decode_data_url("data:image/png;base64," + item["b64_json"]), want[0])

    (result,) = runpod_jobs(core, {"id": "eta", "input": {**body, "eta": 0.7}})
    assert "error" not in result, result
    np.testing.assert_array_equal(decode_data_url(result["images"][0]), want[0])


def test_a_request_naming_no_sampler_gets_the_first_served_one(client: httpx.Client, core: Core, pipe: Any) -> None:
    """The model's default sampler is not among the served ("ddim", "tcd"): a bare request draws with
    the first served one, as warmed, instead of a 422."""
    assert pipe.defaults["sampler"] not in ("ddim", "tcd")
    np.testing.assert_array_equal(predicted(client, BODY), predicted(client, {**BODY, "scheduler": "ddim"}))
    assert core.parse(BODY)[0].sampler == "ddim"
    error = one_error(client.post("/predictions", json={"input": {**BODY, "scheduler": "euler"}}))
    assert error["loc"][-1] == "scheduler" and "'ddim' or 'tcd'" in error["msg"], error  # the schema's enum


def test_requests_with_other_etas_are_never_one_batch(core: Core) -> None:
    """eta is one value per call (its schedule's): part of the batch key."""
    a, _ = core.parse({**BODY, "scheduler": "ddim", "eta": 0.5})
    b, _ = core.parse({**BODY, "scheduler": "ddim"})
    assert a.batch_key != b.batch_key and a.request.eta == 0.5 and b.request.eta == 0.0


@pytest.mark.parametrize("eta", [-0.5, "lots", True, None])
def test_a_bad_eta_is_one_line_422_naming_it(client: httpx.Client, eta: Any) -> None:
    error = one_error(client.post("/predictions", json={"input": {**BODY, "eta": eta}}))
    assert error["loc"][-1] == "eta", error
    r = client.post("/v1/images/generations", json={"prompt": "3", "eta": eta})
    assert r.status_code == 422 and r.json()["error"]["param"] == "eta", r.text
    assert "\n" not in r.json()["error"]["message"]


def test_openapi_lists_every_common_input_a_server_takes(client: httpx.Client) -> None:
    props = client.get("/openapi.json").json()["components"]["schemas"]["Input"]["properties"]
    eta = props["eta"]
    assert eta["description"] == common_spec("eta").description and eta["minimum"] == 0 and eta["default"] == 0
    served = [s.surface_name for s in COMMON_SPECS if "server" in s.surfaces]
    assert "noise" not in props and set(served) <= set(props)
    # Cog's order: the family's inputs first, then the common ones in their declared order, then output_format
    orders = [props[name]["x-order"] for name in (*served, "output_format")]
    assert orders == sorted(orders) and min(orders) > props["class_label"]["x-order"]
    assert props["num_outputs"]["maximum"] == 1 and props["num_inference_steps"]["anyOf"][0]["maximum"] == MAX_STEPS
    assert props["guidance_scale"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 50.0}
    assert props["scheduler"]["anyOf"][0]["enum"] == ["ddim", "tcd"] and props["scheduler"]["x-order"] == \
        20 + served.index("scheduler")


def test_timesteps_without_steps_use_their_count(client: httpx.Client, core: Core, pipe: Any) -> None:
    call = dict(class_labels=3, seed=4, sampler="tcd")
    want = pipe.generate(1, timesteps=[999, 499], **call)
    np.testing.assert_array_equal(want, pipe.generate(1, timesteps=[999, 499], steps=2, **call))
    assert np.abs(want.astype(int) - pipe.generate(1, timesteps=[999, 699], **call)).mean() > 1  # the list counts
    body = {"class_label": 3, "seed": 4, "scheduler": "tcd", "timesteps": [999, 499]}
    np.testing.assert_array_equal(predicted(client, body), want[0])
    job, _ = core.parse(body)
    assert job.steps == 2  # the batch key's steps are the list's count, not the model's default (4)
    (result,) = runpod_jobs(core, {"id": "ts", "input": body})
    assert "error" not in result, result
    np.testing.assert_array_equal(decode_data_url(result["images"][0]), want[0])


def test_timesteps_and_another_step_count_is_one_line(client: httpx.Client, core: Core) -> None:
    """The engine's error names the step count as each surface names it: the field a client sent
    (``num_inference_steps`` on Cog's route, the OpenAI route and the Runpod handler), never the
    engine's keyword ``steps``."""
    body = {"class_label": 3, "scheduler": "tcd", "timesteps": [999, 499]}
    want = "timesteps has 2 entries but num_inference_steps=3; leave num_inference_steps out or give " \
           "num_inference_steps=2"
    error = one_error(client.post("/predictions", json={"input": {**body, "num_inference_steps": 3}}))
    assert error["loc"][-1] == "timesteps" and error["msg"] == want, error
    r = client.post("/v1/images/generations", json={"prompt": "3", "n": 1, "scheduler": "tcd",
                                                    "timesteps": [999, 499], "num_inference_steps": 3})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "timesteps" and r.json()["error"]["message"] == f"timesteps: {want}", r.text
    (result,) = runpod_jobs(core, {"id": "ts-steps", "input": {**body, "num_inference_steps": 3}})
    assert result == {"error": f"timesteps: {want}"}, result
    too_many = list(range(999, 999 - 10 * (MAX_STEPS + 1), -10))
    error = one_error(client.post("/predictions", json={"input": {**body, "timesteps": too_many}}))
    assert error["loc"][-1] == "timesteps" and f"this server's max {MAX_STEPS}" in error["msg"], error


def test_the_cli_takes_eta_and_timesteps_without_steps(model_dir: Path, pipe: Any, tmp_path: Path) -> None:
    from click.testing import CliRunner
    from PIL import Image

    from preheat.cli import main

    def sample(*flags: str) -> Any:
        images = tmp_path / "images"
        result = CliRunner().invoke(main, ["sample", str(model_dir), "--n", "1", "--class", "3", "--seed", "4",
                                           *flags, "--quiet", "--out", str(tmp_path / "s.png"), "--save-images",
                                           str(images)])
        return result, (np.asarray(Image.open(images / "0000.png")) if result.exit_code == 0 else None)

    result, got = sample("--sampler", "ddim", "--steps", "3", "--eta", "0.7")
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(got, pipe.generate(1, sampler="ddim", eta=0.7, **CALL)[0][..., 0])
    result, got = sample("--sampler", "tcd", "--timesteps", "999,499")
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(got, pipe.generate(1, class_labels=3, seed=4, sampler="tcd",
                                                     timesteps=[999, 499])[0][..., 0])
    result, _ = sample("--sampler", "tcd", "--timesteps", "999,499", "--steps", "3")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1, result.output
    assert lines[0] == "error: --timesteps has 2 entries but --steps=3; leave --steps out or give --steps=2", lines


def test_the_cli_options_are_the_declared_common_inputs() -> None:
    """Every common input the CLI takes is an option of ``preheat sample`` with its declared flag,
    text and bounds; one it does not take (``noise``, an array; ``lora_scale``, inside
    ``--lora SRC[:SCALE]``) is not."""
    import click

    from preheat.cli import main
    from preheat.families.inputs import Float, Int

    sample = main.get_command(click.Context(main), "sample")
    options = {o.opts[0]: o for o in sample.params if isinstance(o, click.Option)}
    for spec in COMMON_SPECS:
        if "cli" not in spec.surfaces:
            assert all(o.name != spec.name for o in options.values()), spec.name
            continue
        option = options[spec.cli_flag]
        assert option.name == spec.name and option.help.endswith(spec.describe("cli")), (spec.name, option.help)
        if isinstance(spec.type, (Int, Float)):
            assert (option.type.min, option.type.max) == (spec.type.low, spec.type.high), spec.name
        if spec.cli_form is not None:  # its own syntax, declared: repeated, shown as its metavar
            assert option.multiple and option.metavar == spec.cli_form.metavar, spec.name
    assert "--noise" not in options and "--lora-scale" not in options and options["--eta"].default == 0.0
    assert options["--lora"].metavar == "SRC[:SCALE]"


def test_a_declared_cli_form_parses_the_flag_and_names_it_in_errors() -> None:
    """``--lora SRC[:SCALE]`` is the LoRA spec's declared ``CliForm``: ``CallOptions`` parses the
    repeated texts with it (none given: no ``lora`` keyword at all), and an error about the scale
    it carries (``lora_scale``, a server field whose declared flag is ``--lora``) names ``--lora``."""
    from preheat.cli.options import FLAGS, CallOptions
    from preheat.errors import InvalidArgumentError

    fields = dict(model=None, flags={}, n=None, steps=None, sampler=None, seed=0, guidance=None, eta=0.0,
                  dtype="float32", weights_dtype=None, weights_layers="layerwise", variant=None, cache=None,
                  config=None, controlnet=None, refiner=None, backend="jax", compile_mode="none", encoders_on="device")
    assert "lora" not in CallOptions(lora=(), **fields).common_inputs()  # none given: the call has none
    got = CallOptions(lora=("a.safetensors:0.5", "http://host:8/b.safetensors"), **fields).common_inputs()
    assert got["lora"] == [("a.safetensors", 0.5), ("http://host:8/b.safetensors", 1.0)]
    lora = common_spec("lora")
    assert lora.cli_form is not None and lora.cli_form.parse("x:2") == ("x", 2.0)
    assert FLAGS["lora_scale"] == "--lora" and FLAGS["steps"] == "--steps"  # each declared flag
    from preheat.cli._support import _in_flags

    assert _in_flags(InvalidArgumentError("lora_scale must be finite", argument="lora_scale")) == \
        "--lora: lora_scale must be finite"


def test_an_input_a_surface_does_not_take_is_refused_there() -> None:
    """``InputSpec.surfaces`` decides which surfaces take an input, for a family's inputs as for the
    common ones: the server's fields and the CLI's flags leave out one declared for Python only."""
    from dataclasses import replace

    from pydantic import ValidationError

    from preheat.errors import InvalidArgumentError
    from preheat.families.inputs import InputSpec, Text, typed_flags
    from preheat.server.inputs import family_model

    shown = InputSpec("caption", Text(), "A caption.")
    hidden = replace(shown, name="secret", surfaces=("python",))
    model = family_model((shown, hidden))
    assert model.model_validate({"caption": "x"}).caption == "x"
    with pytest.raises(ValidationError):
        model.model_validate({"secret": "x"})
    assert typed_flags((shown, hidden), "toy", {"--caption": ["x"]}) == {"caption": "x"}
    with pytest.raises(InvalidArgumentError, match="--secret does not apply to a toy model; its inputs are: --caption"):
        typed_flags((shown, hidden), "toy", {"--secret": ["x"]})


def test_an_engine_error_is_worded_with_each_surfaces_names() -> None:
    """``InvalidArgumentError.about`` records the inputs its message names; each surface words it
    with its own names (a server's fields, OpenAI's ``n``, the CLI's flags), the Python call keeps
    the engine's keywords, and an error built without it is left as it is."""
    from preheat.cli.options import FLAGS
    from preheat.errors import InputError, InvalidArgumentError
    from preheat.families.inputs import InputSpec, Text
    from preheat.server.openai_routes import OPENAI_FIELDS
    from preheat.server.inputs import surface_fields

    prompt = InputSpec("prompt", Text(), "What to draw.", per_image=True)
    with pytest.raises(InvalidArgumentError) as caught:
        prompt.check(["a", "b"], 3)
    err = caught.value
    assert str(err) == "got 2 prompts for n=3; give one string or one per image" and err.argument == "prompt"
    fields = surface_fields((prompt,))
    assert err.renamed(fields) == "got 2 prompts for num_outputs=3; give one string or one per image"
    assert err.renamed({**FLAGS, "prompt": "--prompt"}) == "got 2 prompts for --n=3; give one string or one per image"
    served = InputError([("prompt", err.renamed(fields))], source=err, fields=fields)
    assert served.message(OPENAI_FIELDS) == "got 2 prompts for n=3; give one string or one per image"
    assert str(served) == "prompt: got 2 prompts for num_outputs=3; give one string or one per image"  # Runpod
    plain = InvalidArgumentError("steps is odd", argument="steps")
    assert plain.renamed(fields) == "steps is odd" and InputError([("x", "y")]).message(OPENAI_FIELDS) == "y"
    braces = InvalidArgumentError.about("{0}={value!r} is not one of: {options}", "sampler", value="{0}}",
                                        options="a, b")  # a value with braces stays a value
    assert braces.renamed(fields) == "scheduler='{0}}' is not one of: a, b"


class _CountedPipe:
    """``pipe``, with the calls of its family's ``input_specs`` (the declaration's reads) counted."""

    def __init__(self, pipe: Any) -> None:
        self._pipe, self.reads = pipe, 0
        counted = self

        class Family:
            def __getattr__(self, name: str) -> Any:
                return getattr(pipe.family, name)

            def input_specs(self, of: Any) -> Any:
                counted.reads += 1
                return pipe.family.input_specs(of)

        self.family = Family()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


def test_a_request_reads_the_family_s_declaration_once(pipe: Any) -> None:
    """``parse_input`` reads the family's inputs once per request (``family_inputs``: declared and
    offered) and passes them down to every check that needs them, on a valid request as on one
    the checks refuse."""
    from preheat.errors import InputError
    from preheat.server.inputs import Limits, parse_input

    limits = Limits(max_steps=MAX_STEPS)
    counted = _CountedPipe(pipe)
    job, _ = parse_input(BODY, counted, limits)
    assert counted.reads == 1
    assert job == parse_input(BODY, pipe, limits)[0]  # the same job as the pipeline's own parse
    refused = _CountedPipe(pipe)
    with pytest.raises(InputError):
        parse_input({**BODY, "class_label": 999}, refused, limits)
    assert refused.reads == 1


def test_which_server_limit_bounds_an_input_is_declared() -> None:
    """A server narrows an input by the limit its declaration names (``InputSpec.bound``), never by
    matching its name: an input of another name that declares a bound gets that bound, and one
    named like a bounded input that declares none keeps its own type."""
    from dataclasses import replace

    from preheat.families.inputs import SEED_MAX, Float, InputSpec, Int, ServerBound
    from preheat.server.inputs import Limits, served_specs, served_type

    limits = Limits(max_batch_size=4, max_steps=30, max_guidance=7.5, max_lora_scale=2.0)
    assert served_type(InputSpec("count", Int(1), "How many.", bound=ServerBound.BATCH), limits) == Int(1, 4)
    assert served_type(InputSpec("cfg", Float(0.0), "Scale.", bound=ServerBound.GUIDANCE), limits) == Float(0.0, 7.5)
    assert served_type(InputSpec("mix", Float(), "Mix.", bound=ServerBound.LORA_SCALE), limits) == Float(-2.0, 2.0)
    assert served_type(replace(common_spec("steps"), bound=None), limits) == Int(1)
    bounded = {s.surface_name: served_type(s, limits) for s in served_specs() if s.bound is not None}
    assert bounded == {"num_outputs": Int(1, 4), "num_inference_steps": Int(1, 30), "guidance_scale": Float(0.0, 7.5),
                       "seed": Int(0, SEED_MAX - 3), "lora_scale": Float(-2.0, 2.0)}


def test_a_server_s_bounds_are_built_once_per_limits_and_cover_every_bound() -> None:
    """``Limits.bounds`` reads a table built once per Limits (it used to build it on every call);
    a replaced Limits (the core narrows its own at set-up) gets its own, never the old values."""
    from dataclasses import replace

    from preheat.families.inputs import SEED_MAX, ServerBound
    from preheat.server.inputs import Limits

    limits = Limits(max_batch_size=4, max_steps=30, max_guidance=7.5, max_lora_scale=2.0)
    table = limits._bounds
    assert set(table) == set(ServerBound)  # every bound a declaration can name has its values
    assert [limits.bounds(b) for b in ServerBound] == [(None, 4), (None, 30), (None, 7.5), (None, SEED_MAX - 3),
                                                       (-2.0, 2.0)]
    assert limits._bounds is table  # built once
    smaller = replace(limits, max_batch_size=2)
    assert smaller.bounds(ServerBound.BATCH) == (None, 2) and smaller.bounds(ServerBound.SEED) == (None, SEED_MAX - 1)
    assert limits.bounds(ServerBound.BATCH) == (None, 4) and limits == replace(smaller, max_batch_size=4)


def test_the_server_s_schema_code_names_no_common_input() -> None:
    """The derivation of a server's common inputs (their types, defaults and bounds) reads only their
    declarations: no string in it is a common input's keyword or field (read from the source, as
    tests/test_size_names.py reads the size's names)."""
    import ast
    import inspect
    import textwrap

    from preheat.server import inputs

    names = {s.name for s in COMMON_SPECS} | {s.surface_name for s in COMMON_SPECS}
    for fn in (inputs.served_type, inputs.input_model, inputs.Limits.bounds, inputs.Limits._bounds.func):
        found = [node.value for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn))))
                 if isinstance(node, ast.Constant) and node.value in names]
        assert not found, f"{fn.__qualname__} names {found}: declare it on the InputSpec (bound, defaults)"
    assert "n" in {s.name for s in COMMON_SPECS}  # the check looks at something


def test_a_server_s_own_defaults_are_declared() -> None:
    """One image per request and a random seed (reported back): the server's defaults, declared on
    the common inputs (``InputSpec.defaults``), where the Python call's are the family's n and seed 0."""
    from preheat.server.inputs import Limits, input_model

    fields = input_model(Limits()).model_fields
    assert fields["num_outputs"].default == 1 and fields["seed"].default is None
    assert common_spec("seed").default == 0 and common_spec("seed").default_on("server") is None
    assert common_spec("n").default_on("python") is None  # the family's (16 images of a class model)


def test_an_unknown_class_is_named_by_each_surface_s_name_for_the_input(client: httpx.Client, core: Core,
                                                                      pipe: Any) -> None:
    """"unknown class" used to name no input where a surface does not lead the message with the field
    (the Python call, Cog's ``detail`` message): each now names it, by its own name (the CLI's
    ``--class``: tests/test_cli.py)."""
    from preheat.errors import InvalidArgumentError

    classes = f"is not a class of this model; classes are 0..{pipe.num_classes - 1}"
    with pytest.raises(InvalidArgumentError) as err:
        pipe.generate(1, class_labels=[12], steps=3)
    assert str(err.value) == f"class_labels=12 {classes}"
    body = {**BODY, "class_label": 12, "scheduler": "ddim"}  # a sampler this server serves
    error = one_error(client.post("/predictions", json={"input": body}))
    assert error["loc"][-1] == "class_label" and error["msg"] == f"class_label=12 {classes}", error
    r = client.post("/v1/images/generations", json={"class_label": 12, "num_inference_steps": 3,
                                                           "scheduler": "ddim"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "class_label"
    assert r.json()["error"]["message"] == f"class_label: class_label=12 {classes}", r.text
    (result,) = runpod_jobs(core, {"id": "class", "input": body})
    assert result["error"] == f"class_label: class_label=12 {classes}", result
