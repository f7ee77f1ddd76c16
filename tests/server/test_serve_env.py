"""`preheat serve` and `preheat warm` read the deployment's ``PREHEAT_<SETTING>`` variables (the
table Runpod's worker and Ray's replicas read: ``preheat.server.config.ENV_SETTINGS``) where a
flag is absent; a flag wins; an error names what the user wrote (the variable or the flag).

The command line is tested in this process (click's runner; ``serve`` hands its CoreConfig to a
stand-in for the HTTP server), one real server on 127.0.0.1 is started from the environment
alone, and a warm job run in an environment leaves a server started in the same one nothing to
compile.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import click
import httpx
import pytest
from click.testing import CliRunner

from preheat.cli import main
from preheat.server.config import ENV_SETTINGS, env_var
from tests._support.server_fixtures import ServerProcess, wait_status


def _command(name: str) -> click.Command:
    command = main.get_command(click.Context(main), name)
    assert command is not None
    return command


def _setting_params(name: str) -> dict[str, click.Parameter]:
    """The command's parameters that read a variable, by the variable."""
    return {p.envvar: p for p in _command(name).params if p.envvar}


def test_serve_reads_every_setting_of_the_table_and_warm_those_it_declares():
    serve, warm = _setting_params("serve"), _setting_params("warm")
    assert sorted(serve) == sorted(env_var(s) for s in ENV_SETTINGS)  # Runpod's and Ray's table, all of it
    declaration = {"PREHEAT_MODEL", "PREHEAT_DTYPE", "PREHEAT_VARIANT", "PREHEAT_CACHE", "PREHEAT_WEIGHTS_DTYPE",
                   "PREHEAT_WEIGHTS_LAYERS", "PREHEAT_ENCODERS_ON", "PREHEAT_CONFIG", "PREHEAT_CONTROLNET", "PREHEAT_REFINER", "PREHEAT_PROGRESS",
                   "PREHEAT_MAX_BATCH_SIZE",
                   "PREHEAT_SAMPLERS", "PREHEAT_SIZES", "PREHEAT_GUIDANCE", "PREHEAT_INPUTS", "PREHEAT_INPUT_VALUES", "PREHEAT_DEVICES",
                   "PREHEAT_FSDP", "PREHEAT_LORA_RANKS"}
    assert set(warm) == declaration  # what warm compiles, read as serve reads it
    assert all(warm[v].name == serve[v].name for v in warm)  # the same parameter on both commands
    text = " ".join(CliRunner().invoke(main, ["serve", "--help"]).output.split())  # help wraps its lines
    assert "PREHEAT_MODEL" in text and all(f"env var: {v}" in text for v in serve if v != "PREHEAT_MODEL")


@pytest.fixture
def served(monkeypatch) -> dict[str, Any]:
    """``preheat serve``'s CoreConfig and options, handed to a stand-in for the HTTP server (its
    model paths are never read: the check that they exist stands aside too; tests/server/test_cli.py
    has its own)."""
    import preheat.cli.serve as serve_cli
    import preheat.server.serve as serving

    monkeypatch.setattr(serve_cli, "_check_models", lambda *a, **k: None)

    got: dict[str, Any] = {}

    def serve(config: Any, **options: Any) -> int:
        got.update(config=config, **options)
        return 0

    monkeypatch.setattr(serving, "serve", serve)
    return got


def _serve(served: dict[str, Any], args: list[str], env: dict[str, str]) -> Optional[Any]:
    served.clear()
    result = CliRunner().invoke(main, ["serve", *args], env=env)
    served["result"] = result
    return served.get("config")


ENV = {"PREHEAT_MODEL": "/models/sd", "PREHEAT_SIZES": "512x512, 768x512", "PREHEAT_MAX_BATCH_SIZE": "2",
       "PREHEAT_SAMPLERS": "euler,ddim", "PREHEAT_GUIDANCE": "on", "PREHEAT_INPUTS": "none",
       "PREHEAT_PROGRESS": "off", "PREHEAT_MAX_STEPS": "30", "PREHEAT_RETUNE_IDLE_S": "off",
       "PREHEAT_LORA_RANKS": "16", "PREHEAT_DTYPE": "bfloat16", "PREHEAT_MAX_QUEUE": "5", "PREHEAT_FSDP": "2",
       "PREHEAT_BATCH_WAIT_MS": "3.5", "PREHEAT_MAX_IMAGE_PIXELS": "4096", "PREHEAT_CACHE": "xla"}


def test_serve_takes_its_settings_from_the_environment_as_runpod_does(served):
    from preheat.integrations.runpod import config_from_env

    config = _serve(served, [], ENV)
    assert config is not None, served["result"].output
    assert (config.model, config.sizes, config.max_batch_size, config.samplers, config.guidance, config.inputs,
            config.progress, config.max_steps, config.retune_idle_s, config.lora_ranks, config.dtype, config.max_queue,
            config.fsdp, config.batch_wait_ms, config.max_image_pixels, config.cache) == (
        "/models/sd", ((512, 512), (768, 512)), 2, ("euler", "ddim"), ("on",), (), False, 30, None, (16,),
        "bfloat16", 5, 2, 3.5, 4096, "xla")
    runpod = config_from_env({**os.environ, **ENV})  # the suite's PREHEAT_DEVICES=1 too (tests/conftest.py)
    assert config.warm_set() == runpod.warm_set()  # what Runpod's worker warms in the same environment
    # set-up messages (an unusable size, an undeclared input) name the variables the values came from
    assert (config.names.sizes, config.names.inputs, config.names.max_steps) == (
        "PREHEAT_SIZES", "PREHEAT_INPUTS", "PREHEAT_MAX_STEPS")


def test_a_flag_wins_over_its_variable(served):
    config = _serve(served, ["/models/other", "--sizes", "256x256", "--max-batch-size", "4", "--progress",
                             "--inputs", "negative_prompt"], ENV)
    assert config is not None, served["result"].output
    assert (config.model, config.sizes, config.max_batch_size, config.progress, config.inputs) == (
        "/models/other", ((256, 256),), 4, True, ("negative_prompt",))
    assert config.samplers == ("euler", "ddim")  # the others still from theirs
    assert (config.names.sizes, config.names.inputs) == ("--sizes", "--inputs")


@pytest.mark.parametrize("env, args, line", [
    ({"PREHEAT_MAX_BATCH_SIZE": "two"}, [],
     "error: Invalid value for 'PREHEAT_MAX_BATCH_SIZE': 'two' is not a valid integer. (main serve --help)"),
    ({}, ["--max-batch-size", "two"],
     "error: Invalid value for '--max-batch-size': 'two' is not a valid integer. (main serve --help)"),
    ({"PREHEAT_SIZES": "512"}, [], "error: PREHEAT_SIZES '512' must be WIDTHxHEIGHT, e.g. 512x512"),
    ({"PREHEAT_SIZES": "512x512"}, ["--sizes", "512"], "error: --sizes '512' must be WIDTHxHEIGHT, e.g. 512x512"),
    ({"PREHEAT_MAX_BATCH_SIZE": "0"}, [], "error: PREHEAT_MAX_BATCH_SIZE 0 must be in 1..1024"),
    ({"PREHEAT_FSDP": "0"}, [],
     "error: Invalid value for 'PREHEAT_FSDP': 0 is not in the range x>=1. (main serve --help)"),
    ({"PREHEAT_PROGRESS": "sometimes"}, [], "error: Invalid value for 'PREHEAT_PROGRESS': 'sometimes' is not a "
                                            "valid boolean."),
    ({"PREHEAT_RETUNE_IDLE_S": "soon"}, [], "error: PREHEAT_RETUNE_IDLE_S 'soon' must be seconds (a number) or off"),
    ({"PREHEAT_SAMPLERS": "warp"}, [], "error: PREHEAT_SAMPLERS 'warp' is unknown; choose from "),
    ({"PREHEAT_GUIDANCE": "maybe"}, [], "error: PREHEAT_GUIDANCE 'maybe' must be off, on or off,on"),
    ({"PREHEAT_DEVICES": "two"}, [], "error: PREHEAT_DEVICES 'two' must be 'all', a count or comma-separated"),
    ({"PREHEAT_CACHE": "some"}, [], "error: Invalid value for 'PREHEAT_CACHE': 'some' is not one of 'full', 'xla', "
                                    "'off'."),
])
def test_a_malformed_value_is_one_line_naming_what_gave_it(served, env, args, line):
    assert _serve(served, args, env) is None
    result = served["result"]
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.startswith(line), result.output


def test_the_engines_devices_variable_is_no_torch_flag(served):
    """PREHEAT_DEVICES was the JAX engine's default before serve read the table (the suite sets
    it): `serve --backend torch` in such an environment starts; a --devices flag is refused."""
    config = _serve(served, ["--backend", "torch"], {"PREHEAT_DEVICES": "2"})
    assert config is not None and config.backend == "torch", served["result"].output
    assert _serve(served, ["--backend", "torch", "--devices", "2"], {}) is None
    assert served["result"].output.startswith("error: --devices and --fsdp apply to --backend jax")
    assert _serve(served, ["--backend", "torch"], {"PREHEAT_FSDP": "2"}) is None
    assert served["result"].output.startswith("error: --devices and PREHEAT_FSDP apply to --backend jax")


def test_warm_declares_from_the_same_variables_and_names_them(tmp_path):
    """The built-in model: a dry run lists the environment's signatures; an unusable size from
    the environment is resolve's line naming the variable, from the flag naming the flag."""
    env = {"PREHEAT_MAX_BATCH_SIZE": "2", "PREHEAT_GUIDANCE": "off", "PREHEAT_SAMPLERS": "euler"}
    result = CliRunner().invoke(main, ["warm", "--dry-run", "--json"], env=env)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output[result.output.index("{"):])["signatures"]
    assert [row["signature"].split()[:3] for row in rows] == [["euler", "batch", "1"], ["euler", "batch", "2"]]
    bad = CliRunner().invoke(main, ["warm", "--dry-run"], env={"PREHEAT_SIZES": "33x33"})
    assert bad.exit_code == 2 and bad.output.startswith("error: PREHEAT_SIZES 33x33: "), bad.output
    flag = CliRunner().invoke(main, ["warm", "--dry-run", "--sizes", "33x33"], env={"PREHEAT_SIZES": "33x33"})
    assert flag.exit_code == 2 and flag.output.startswith("error: --sizes 33x33: "), flag.output


def test_warm_in_an_environment_leaves_a_server_in_it_nothing_to_compile(served, tmp_path, monkeypatch):
    """`preheat warm` in a pod's environment, then `preheat serve` in the same one: the server's
    config (from the command line, as a container's CMD starts it) warms up from the cache alone."""
    from preheat.server.core import Core

    monkeypatch.setenv("PREHEAT_HOME", str(tmp_path / "root"))
    env = {"PREHEAT_MAX_BATCH_SIZE": "2", "PREHEAT_GUIDANCE": "off", "PREHEAT_MAX_STEPS": "20"}
    warmed = CliRunner().invoke(main, ["warm", "--quiet"], env=env)
    assert warmed.exit_code == 0 and "2 signature(s) ready (2 none)" in warmed.output, warmed.output
    config = _serve(served, [], env)
    assert config is not None, served["result"].output
    core = Core(config).start()
    try:
        assert core.wait_setup(300) and core.status == "READY", core.setup.logs
        reg = core.metrics.registry
        layers = {layer: reg.get_sample_value("preheat_warmup_programs_total", {"cache_layer": layer}) or 0
                  for layer in ("none", "memory", "aot", "xla")}
        assert layers["none"] == 0 and sum(layers.values()) == 2, layers  # batches 1, 2; no compile
    finally:
        core.close()
    cold = _serve(served, [], {**env, "PREHEAT_MAX_BATCH_SIZE": "4"})  # another environment: another set
    assert cold is not None and cold.warm_set() != config.warm_set()


def test_a_server_started_from_the_environment_alone_serves_what_it_says(model_dir: Path,
                                                                        server_env: dict[str, str]) -> None:
    """A real `python -m preheat.server` with no model argument and no settings flags: its
    OpenAPI document offers only the environment's sampler and step limit, and a request for
    another sampler is refused."""
    env = {**server_env, "PREHEAT_MODEL": str(model_dir), "PREHEAT_SAMPLERS": "euler", "PREHEAT_GUIDANCE": "off",
           "PREHEAT_MAX_BATCH_SIZE": "1", "PREHEAT_MAX_STEPS": "7"}
    server = ServerProcess([], env=env)
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            wait_status(c, "READY", timeout=300)
            props = c.get("/openapi.json").json()["components"]["schemas"]["Input"]["properties"]
            assert props["scheduler"]["anyOf"][0]["enum"] == ["euler"]
            steps = props["num_inference_steps"]
            assert 7 in [s.get("maximum") for s in steps.get("anyOf", [steps])], steps
            refused = c.post("/predictions", json={"input": {"scheduler": "dpmpp_2m"}})
            assert refused.status_code == 422, refused.text
            done = c.post("/predictions", json={"input": {"seed": 1, "num_inference_steps": 2, "scheduler": "euler",
                                                          "guidance_scale": 1.0}})
            assert done.status_code == 200 and done.json()["status"] == "succeeded", done.text
    finally:
        server.kill()
