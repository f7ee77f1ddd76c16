"""Each surface words an input error with its own names for the inputs: the sampler's errors
(``SchedulerConfigError``) and the declared types' checks (``Text``, ``Pair``, ``Ints``, ``Label``)
are built by ``about`` with the inputs they name, so that ``renamed`` writes them again as a server
(``num_inference_steps``, ``scheduler``) or the CLI (``--steps``, ``--sampler``) names them.

These are the engine-level halves (no model: the sampler functions and the types are called
directly); the surfaces themselves are tested over HTTP, the Runpod handler and the CLI in
``tests/server/test_image_sd_server.py`` and by the family contract suite."""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest

from preheat.errors import InvalidArgumentError, NamesInputs, SchedulerConfigError
from preheat.families.inputs import Ints, Label, Pair, Text
from preheat.samplers import SchedulerConfig, make_plan
from preheat.samplers import strength_start, with_overrides

COG = {"steps": "num_inference_steps", "sampler": "scheduler", "class_labels": "class_label"}
CLI = {"steps": "--steps", "sampler": "--sampler", "eta": "--eta", "strength": "--strength",
       "timesteps": "--timesteps", "timestep_spacing": "--timestep-spacing", "prompt": "--prompt",
       "original_size": "--original-size", "class_labels": "--class"}


def _raised(call: Callable[[], Any], kind: type[Exception]) -> NamesInputs:
    with pytest.raises(kind) as err:
        call()
    assert isinstance(err.value, NamesInputs) and "\n" not in str(err.value)
    return err.value


SAMPLER_ERRORS = {  # the engine's message, and what Cog's field names make of it
    "timesteps": (lambda: make_plan(SchedulerConfig(), "euler", 1, timesteps=[800]),
                  "timesteps is not supported for sampler 'euler'; only lcm, tcd take it",
                  "timesteps is not supported for scheduler 'euler'; only lcm, tcd take it"),
    "strength": (lambda: strength_start(2, 0.1, "sd"),
                 "strength=0.1 with steps=2 runs no step; raise strength or steps",
                 "strength=0.1 with num_inference_steps=2 runs no step; raise strength or num_inference_steps"),
    "eta": (lambda: make_plan(SchedulerConfig(), "euler", 10, eta=0.5),
            "eta=0.5 is only supported for sampler 'ddim' or 'tcd'; use eta=0.0 for sampler 'euler'",
            "eta=0.5 is only supported for scheduler 'ddim' or 'tcd'; use eta=0.0 for scheduler 'euler'"),
    "steps": (lambda: make_plan(SchedulerConfig(), "euler", 1001),
              "steps=1001 is not supported; it must be in [1, 1000] (num_train_timesteps)",
              "num_inference_steps=1001 is not supported; it must be in [1, 1000] (num_train_timesteps)"),
    "timestep_spacing": (lambda: with_overrides(SchedulerConfig(), "lcm", {"timestep_spacing": "trailing"}),
                         "timestep_spacing does not apply to sampler 'lcm': LCMScheduler does not read it",
                         "timestep_spacing does not apply to scheduler 'lcm': LCMScheduler does not read it"),
    "custom timesteps": (lambda: make_plan(SchedulerConfig(), "tcd", 2, timesteps=[800]),
                         "timesteps has 1 entries but steps=2; pass steps=1",
                         "timesteps has 1 entries but num_inference_steps=2; pass num_inference_steps=1"),
}


@pytest.mark.parametrize("case", list(SAMPLER_ERRORS))
def test_a_sampler_error_names_each_input_by_the_surface_s_name(case: str) -> None:
    call, engine, cog = SAMPLER_ERRORS[case]
    err = _raised(call, SchedulerConfigError)
    assert str(err) == engine  # the Python call's words are the engine's keywords
    assert err.renamed(COG) == cog
    cli = err.renamed(CLI)
    assert not [k for k in CLI if re.search(rf"(?<![\w-]){k}(?![\w-])", cli)], cli  # every input named by its flag


def test_the_cli_words_a_sampler_error_with_its_flags() -> None:
    err = _raised(lambda: strength_start(2, 0.1, "sd"), SchedulerConfigError)
    assert err.renamed(CLI) == "--strength=0.1 with --steps=2 runs no step; raise --strength or --steps"
    err = _raised(lambda: make_plan(SchedulerConfig(), "euler", 1, timesteps=[800]), SchedulerConfigError)
    assert err.renamed(CLI) == "--timesteps is not supported for --sampler 'euler'; only lcm, tcd take it"


TYPE_ERRORS = {  # a type's check, the input it is about, and the CLI's words for it
    "Text": (lambda: Text(max_length=3).check("prompt", "four"), "prompt has 4 characters; at most 3",
             "--prompt has 4 characters; at most 3"),
    "Text type": (lambda: Text().check("prompt", 3), "prompt must be a string or a list of strings, not int",
                  "--prompt must be a string or a list of strings, not int"),
    "Pair": (lambda: Pair().check("original_size", (-1, -1)),
             "original_size must be two non-negative ints (height, width), got (-1, -1)",
             "--original-size must be two non-negative ints (height, width), got (-1, -1)"),
    "Ints": (lambda: Ints(0, 999).check("timesteps", [1000]),
             "timesteps must be a list of one or more ints in [0, 999], got [1000]",
             "--timesteps must be a list of one or more ints in [0, 999], got [1000]"),
    "Label": (lambda: Label(None).check("class_labels", 3), "class_labels given, but this model is not "
              "class-conditional", "--class given, but this model is not class-conditional"),
}


@pytest.mark.parametrize("case", list(TYPE_ERRORS))
def test_a_declared_type_s_check_names_the_input_by_the_surface_s_name(case: str) -> None:
    call, engine, cli = TYPE_ERRORS[case]
    err = _raised(call, InvalidArgumentError)
    assert str(err) == engine and err.argument == engine.split(" ")[0]
    assert err.renamed(CLI) == cli
    if case == "Label":
        assert err.renamed(COG) == "class_label given, but this model is not class-conditional"
