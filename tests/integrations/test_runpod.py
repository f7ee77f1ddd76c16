"""The Runpod handler: the server's parsing and batching core behind runpod's SDK.

In-process: the async handler with an injected core (progress updates recorded by replacing
``runpod.serverless.progress_update``). Subprocess: the SDK's own local test mode
(``python -m preheat.integrations.runpod --test_input ...``), which runs one job and exits
0/1 - offline: runpod 1.12's local mode makes no network calls, and the handler skips
progress updates when no Runpod job API is configured.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import preheat.integrations.runpod as rp
from preheat.server.core import Core, CoreConfig
from preheat.server.images import decode_data_url

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def core(pipe: Any):
    # guided programs only: every job below takes the model's default guidance (on); buckets 1, 2, 4 stay
    core = Core(CoreConfig(max_batch_size=4, batch_wait_ms=0, max_steps=20, guidance=("on",)), pipe=pipe)
    rp.get_core(core)
    assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
    yield core
    core.close()
    rp._core = None


def test_handler_returns_the_seed_images_and_reports_progress(core: Core, pipe: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import runpod

    sent: list[tuple[str, dict]] = []
    monkeypatch.setenv("RUNPOD_WEBHOOK_GET_JOB", "http://127.0.0.1:9/never-called")
    monkeypatch.setattr(runpod.serverless, "progress_update", lambda job, progress: sent.append((job["id"], progress)))
    job = {"id": "job-1", "input": {"class_label": "6", "num_outputs": 2, "seed": 21}}
    result = asyncio.run(rp.handler(job))
    assert "error" not in result, result
    assert result["seed"] == 21 and len(result["images"]) == 2
    got = np.stack([decode_data_url(u) for u in result["images"]])
    assert np.array_equal(got, pipe.generate(2, class_labels=6, seed=21))  # alone: the same batch of 2
    assert [p["status"] for _, p in sent] == ["queued", "processing"] and {i for i, _ in sent} == {"job-1"}


@pytest.mark.parametrize(("inp", "field"), [({"num_outputs": 5}, "num_outputs"), ({"scheduler": "x"}, "scheduler"),
                                            ({"prompt": "a cat"}, "prompt"), ({"seed": -1}, "seed"), ([1], "input"),
                                            ({"steps": 3}, "steps")])
def test_handler_reports_bad_input_as_an_error(core: Core, inp: Any, field: str) -> None:
    result = asyncio.run(rp.handler({"id": "bad", "input": inp}))
    assert set(result) == {"error"} and result["error"].startswith(f"{field}:"), result


def test_concurrent_jobs_share_one_engine_call(core: Core) -> None:
    async def many() -> list[dict]:
        jobs = [asyncio.ensure_future(rp.handler({"id": f"j{i}", "input": {"seed": i}})) for i in range(4)]
        for _ in range(6000):  # bounded: only a hang runs out
            if core.queue_depth == 4:
                break
            await asyncio.sleep(0.01)
        core.resume()  # all four are queued: they go as one batch
        return await asyncio.gather(*jobs)

    before = core.batcher.stats["batches"]
    core.pause()
    try:
        results = asyncio.run(many())
    finally:
        core.resume()
    assert all(len(r["images"]) == 1 for r in results)
    assert core.batcher.stats["batches"] - before == 1
    assert rp.concurrency_modifier(1) == 4


def test_sdk_local_test_mode_runs_a_job_offline(model_dir: Path, server_env: dict[str, str], tmp_path: Path) -> None:
    # the worker declares what the jobs use (batch 1, the model's default guidance: on): one program to warm
    env = dict(os.environ, JAX_PLATFORMS="cpu", PREHEAT_MODEL=str(model_dir), PREHEAT_MAX_BATCH_SIZE="1",
               PREHEAT_GUIDANCE="on", **server_env)
    env.pop("RUNPOD_WEBHOOK_GET_JOB", None)
    good = json.dumps({"input": {"class_label": 3, "seed": 2, "num_inference_steps": 2}})
    bad = json.dumps({"input": {"num_outputs": 2}})  # over this worker's max batch of 1
    runs = {}
    for name, payload in (("good", good), ("bad", bad)):
        runs[name] = subprocess.run([sys.executable, "-m", "preheat.integrations.runpod", "--test_input", payload],
                                    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = runs["good"].stdout + runs["good"].stderr
    assert runs["good"].returncode == 0, out[-3000:]
    assert "completed successfully" in out and "data:image/png;base64," in out
    out = runs["bad"].stdout + runs["bad"].stderr
    assert runs["bad"].returncode == 1, out[-3000:]
    assert "num_outputs: Input should be less than or equal to 1" in out


def test_runpod_and_ray_read_every_setting_from_one_table() -> None:
    """Each ``PREHEAT_<SETTING>`` reaches the server's config, the same on Runpod and on a Ray replica
    (they used to keep two lists, and neither read PREHEAT_WEIGHTS_LAYERS)."""
    pytest.importorskip("ray.serve")
    from preheat.integrations.ray import RayOptions
    from preheat.server.config import ENV_SETTINGS, env_var

    given = {"model": "/m", "dtype": "bfloat16", "variant": "fp16", "cache": "xla", "weights_dtype": "float8_e4m3fn",
             "weights_layers": "linear", "config": "/c", "controlnet": "/cn", "refiner": "/r", "progress": "off",
             "max_batch_size": "3",
             "samplers": "ddim,euler", "sizes": "64x32", "guidance": "on", "inputs": "image",
             "input_values": "max_sequence_length=256", "devices": "2",
             "fsdp": "2",
             "lora_ranks": "16", "max_loras": "5", "lora_dir": "/l", "max_image_pixels": "4096",
             "batch_wait_ms": "2.5", "max_queue": "9", "max_steps": "7",
             "retune_idle_s": "off", "encoders_on": "host"}
    assert set(given) == set(ENV_SETTINGS)
    env = {env_var(name): text for name, text in given.items()}
    runpod, ray = rp.config_from_env(env), RayOptions.from_env(env).core_config()
    assert runpod == ray
    default = CoreConfig()
    assert [name for name in ENV_SETTINGS if getattr(runpod, name) == getattr(default, name)] == []
    assert (runpod.sizes, runpod.samplers, runpod.progress, runpod.batch_wait_ms) == (((64, 32),), ("ddim", "euler"),
                                                                                     False, 2.5)
    assert runpod.inputs == ("image",) and runpod.warm_set().inputs == ("image",)
    assert runpod.warm_set().input_values == (("max_sequence_length", ("256",)),)  # typed by the family at set-up
    from preheat.errors import InvalidArgumentError
    from preheat.server.config import typed_setting

    with pytest.raises(InvalidArgumentError, match="sizes 5: .*not iterable"):  # a typed value of the wrong shape
        RayOptions.from_args({"sizes": 5})
    assert typed_setting("max_image_pixels", "0") == 0  # refused by the core, as `serve` refuses it


def test_a_malformed_setting_stops_the_worker_in_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PREHEAT_MAX_BATCH_SIZE="0")  # in range is the core's check
    env.pop("RUNPOD_WEBHOOK_GET_JOB", None)
    run = subprocess.run([sys.executable, "-m", "preheat.integrations.runpod"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == "error: PREHEAT_MAX_BATCH_SIZE 0 must be in 1..1024"


@pytest.mark.parametrize("name, text, line", [
    ("PREHEAT_MAX_BATCH_SIZE", "2000", "PREHEAT_MAX_BATCH_SIZE 2000 must be in 1..1024"),
    ("PREHEAT_MAX_QUEUE", "0", "PREHEAT_MAX_QUEUE 0 must be >= 1"),
    ("PREHEAT_MAX_LORAS", "0", "PREHEAT_MAX_LORAS 0 must be >= 1"),
    ("PREHEAT_BATCH_WAIT_MS", "-1", "PREHEAT_BATCH_WAIT_MS -1.0 must be >= 0"),
    ("PREHEAT_MAX_IMAGE_PIXELS", "0", "PREHEAT_MAX_IMAGE_PIXELS 0 must be >= 1"),  # as `serve` refuses 0
    ("PREHEAT_LORA_DIR", "{tmp}/absent", "PREHEAT_LORA_DIR '{tmp}/absent' is not a folder here"),
])
def test_the_worker_refuses_what_serve_refuses_naming_the_variable(name, text, line, tmp_path) -> None:
    """The core checks its limits (``CoreConfig.check``), so Runpod's worker, whose settings skip
    ``serve``'s options, refuses a value out of range in one line, before anything loads: a queue of
    0 was a traceback, a LoRA folder that is not there failed each request instead of the start."""
    from preheat.errors import InvalidArgumentError

    config = rp.config_from_env({name: text.format(tmp=tmp_path)})
    with pytest.raises(InvalidArgumentError) as err:
        Core(config, loader=lambda _: pytest.fail("loaded before the check"))
    assert str(err.value) == line.format(tmp=tmp_path)


def test_worker_settings_come_from_the_environment() -> None:
    config = rp.config_from_env({"PREHEAT_MODEL": "hf://org/sd", "PREHEAT_SIZES": "512x512, 768x512",
                                 "PREHEAT_DTYPE": "bfloat16", "PREHEAT_SAMPLERS": "euler,dpmpp_2m"})
    assert config.model == "hf://org/sd" and config.dtype == "bfloat16"
    assert config.sizes == ((512, 512), (768, 512)) and config.samplers == ("euler", "dpmpp_2m")
    assert rp.config_from_env({}).sizes == () and rp.config_from_env({}).dtype == "float32"
    from preheat.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="^PREHEAT_SIZES '512' must be WIDTHxHEIGHT, e.g. 512x512$"):
        rp.config_from_env({"PREHEAT_SIZES": "512"})  # named as the worker was given it (the CLI's: --sizes)
    loaded = rp.config_from_env({"PREHEAT_VARIANT": "fp16", "PREHEAT_WEIGHTS_DTYPE": "float8_e4m3fn",
                                 "PREHEAT_PROGRESS": "off"})
    assert (loaded.variant, loaded.weights_dtype, loaded.progress) == ("fp16", "float8_e4m3fn", False)
    assert rp.config_from_env({}).progress is True and rp.config_from_env({"PREHEAT_PROGRESS": "TRUE"}).progress
    with pytest.raises(InvalidArgumentError, match="PREHEAT_PROGRESS 'sometimes' must be on or off"):
        rp.config_from_env({"PREHEAT_PROGRESS": "sometimes"})
    for name, text, what in [("PREHEAT_MAX_BATCH_SIZE", "x", "an int"), ("PREHEAT_BATCH_WAIT_MS", "soon", "a number"),
                             ("PREHEAT_MAX_IMAGE_PIXELS", "4k", "an int")]:
        with pytest.raises(InvalidArgumentError, match=f"{name} '{text}' must be {what}"):
            rp.config_from_env({name: text})
    assert rp.config_from_env({"PREHEAT_MAX_IMAGE_PIXELS": "1048576"}).max_image_pixels == 1048576
    lora = rp.config_from_env({"PREHEAT_LORA_RANKS": "16, 64", "PREHEAT_MAX_LORAS": "3"})
    assert lora.lora_ranks == (16, 64) and lora.max_loras == 3 and lora.warm_set().lora_ranks == (16, 64)
    assert rp.config_from_env({}).lora_ranks == () and rp.config_from_env({}).max_loras == 8
    with pytest.raises(InvalidArgumentError, match="PREHEAT_LORA_RANKS 'x' must be rank buckets"):
        rp.config_from_env({"PREHEAT_LORA_RANKS": "x"})
    with pytest.raises(InvalidArgumentError, match="buckets: 16, 32, 64, 128"):
        rp.config_from_env({"PREHEAT_LORA_RANKS": "8"}).warm_set()


@pytest.mark.parametrize(("config", "steps", "sizes"), [
    (CoreConfig(max_steps=2, sizes=((33, 33),)), "--max-steps", "--sizes"),  # preheat serve (and its Cog routes)
    (rp.config_from_env({"PREHEAT_MAX_STEPS": "2", "PREHEAT_SIZES": "33x33"}), "PREHEAT_MAX_STEPS", "PREHEAT_SIZES"),
])
def test_set_up_messages_name_each_setting_as_the_surface_was_given_it(pipe: Any, config: CoreConfig, steps: str,
                                                                       sizes: str) -> None:
    """The server's ``CoreConfig.names`` (``preheat.warm.SettingNames``): the command line's options,
    or the worker's variables. A size the model cannot make fails set-up before anything compiles."""
    core = Core(config, pipe=pipe).start()
    try:
        assert core.wait_setup(300) and core.setup.status == "failed"
        assert f"default 4 steps exceed {steps} 2;" in "\n".join(core.setup.logs), core.setup.logs
        assert core.setup.error == f"{sizes} 33x33: width=33: this model makes width 16 only"
    finally:
        core.close()
