"""Runpod serverless worker: the same parsing and batching core as ``preheat serve``.

    import runpod
    from preheat.integrations.runpod import handler, concurrency_modifier
    runpod.serverless.start({"handler": handler, "concurrency_modifier": concurrency_modifier})

or simply ``python -m preheat.integrations.runpod`` (also: ``--test_input '{"input": {...}}'``
for the SDK's local test mode, which runs one job and exits 0 on success).

A job's ``input`` takes Cog's input fields: the served family's declared inputs by their Cog
names (``prompt``, ``negative_prompt``, ``class_label``, ``width``, SDXL's ``original_size``, an
image-conditioned model's ``image`` / ``mask`` / ``strength``, ...: ``Family.input_specs``; images
as http(s) URLs, fetched through the guarded fetch, or data URIs), ``num_outputs``, ``num_inference_steps``, ``guidance_scale``,
``scheduler``, ``seed``, ``eta``, ``output_format``, ``lora_weights`` (a path, http(s):// or hf:// LoRA)
and ``lora_scale`` (the common inputs a server takes, ``preheat.server.inputs.served_specs``;
``preheat.server.inputs.parse_input``, the same parse as Cog's route).
The result is ``{"images": [data URLs], "seed": int, "metrics": {...}}``, or
``{"error": "<field>: <message>"}`` for bad input. ``handler`` is async, so with a concurrency
modifier > 1 the SDK runs several jobs at once and the core batches them into one engine call.

The engine is loaded once per process (at ``python -m`` start, or on the first job), from
``$PREHEAT_MODEL`` (default: the built-in model). The other knobs are the server's settings,
each as ``PREHEAT_<SETTING>`` (``preheat.settings.ENV_SETTINGS``: ``PREHEAT_DTYPE``,
``PREHEAT_SIZES`` = ``512x512,768x512``, ``PREHEAT_SAMPLERS``, ``PREHEAT_GUIDANCE`` = ``off,on``,
``PREHEAT_INPUTS`` = ``negative_prompt`` (the optional inputs offered; ``none``: text only),
``PREHEAT_INPUT_VALUES`` = ``max_sequence_length=256`` (a static input's served values),
``PREHEAT_MAX_BATCH_SIZE``, ``PREHEAT_LORA_RANKS``, ``PREHEAT_LORA_DIR``, ``PREHEAT_CONFIG`` for a
single file, ``PREHEAT_WEIGHTS_DTYPE``, ``PREHEAT_PROGRESS`` = ``off`` as ``serve --no-progress``, ...;
docs/serving.md lists them all); a malformed one stops the worker with one line naming it. The
compile cache lives on the network volume automatically (``/runpod-volume/preheat``, see
``preheat.cache.root``), so a cold worker with a warm volume starts hot.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Mapping, Optional

from preheat.errors import InputError, MissingExtraError, NotAccepting, PreheatError, QueueFull

try:
    from preheat.server.core import Core, CoreConfig
    from preheat.settings import env_var, settings_from_env, typed_setting
    from preheat.warm import SettingNames
except ModuleNotFoundError as _err:  # python -m without the serve extra: one line, never a traceback
    if __name__ != "__main__" or MissingExtraError.of(_err, "the Runpod handler") is None:
        raise
    raise SystemExit(f"error: {MissingExtraError.of(_err, 'the Runpod handler')}") from None

__all__ = ["handler", "concurrency_modifier", "get_core", "config_from_env", "main"]

_core: Optional[Core] = None
_lock = threading.Lock()


def config_from_env(env: Optional[Mapping[str, str]] = None) -> CoreConfig:
    """The worker's CoreConfig from ``PREHEAT_<SETTING>`` (``preheat.settings.ENV_SETTINGS``); a
    malformed value is one line naming its variable."""
    env = os.environ if env is None else env
    settings = settings_from_env(env)
    return CoreConfig(**{name: typed_setting(name, text, env_var(name)) for name, text in settings.items()},
                      names=SettingNames.by(env_var))  # set-up errors name the variable


def get_core(core: Optional[Core] = None) -> Core:
    """The process-wide core (created and started on first use). Passing ``core`` installs it
    instead (tests; embedding in a bigger worker)."""
    global _core
    with _lock:
        if core is not None:
            _core = core.start()
        elif _core is None:
            _core = Core(config_from_env()).start()
        return _core


def concurrency_modifier(current: int) -> int:
    """Jobs the SDK may run at once: one full batch."""
    return get_core().config.max_batch_size


def _on_runpod() -> bool:
    return bool(os.environ.get("RUNPOD_WEBHOOK_GET_JOB"))


def send_progress(job: dict[str, Any], progress: dict[str, Any]) -> None:
    """``runpod.serverless.progress_update`` on a real worker; locally (no job API) it would only
    fail to reach the network, so it is skipped there."""
    if not _on_runpod():
        return
    import runpod

    runpod.serverless.progress_update(job, progress)


async def handler(job: dict[str, Any]) -> dict[str, Any]:
    """Runpod handler: ``job["input"]`` -> ``{"images", "seed", "metrics"}`` or ``{"error"}``."""
    core = get_core()
    if not core.wait_setup(0):
        send_progress(job, {"status": "warming up"})
        await asyncio.to_thread(core.wait_setup)
    raw = job.get("input")
    try:
        parsed, given = await core.parse_async(raw if raw is not None else {})
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def listener(event: str, snap: dict) -> None:
            if event == "start":  # through the loop: after "queued", which is sent before the first await
                loop.call_soon_threadsafe(send_progress, job, {"status": "processing"})
            elif event == "completed":
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(snap))

        pred, _ = core.submit(parsed, given, prediction_id=None, listener=listener)
    except (InputError, QueueFull, NotAccepting) as err:
        return {"error": str(err)}
    send_progress(job, {"status": "queued", "queue_depth": core.queue_depth})
    snap = await done
    if snap["status"] != "succeeded":
        return {"error": snap["error"] or f"prediction {snap['status']}"}
    return {"images": snap["output"], "seed": parsed.seed, "metrics": snap["metrics"]}


def main() -> None:
    try:
        import runpod
    except ModuleNotFoundError as err:
        missing = MissingExtraError.of(err, "the Runpod handler")
        if missing is None:
            raise
        raise SystemExit(f"error: {missing}") from None

    try:
        core = get_core()
    except PreheatError as err:  # a malformed PREHEAT_* setting: one line, never a traceback
        raise SystemExit(f"error: {err}") from None
    core.wait_setup()
    if core.setup.status == "failed":
        print(f"preheat: set-up failed: {core.setup.error}", flush=True)
        # still start: every job then reports the set-up error instead of hanging
    runpod.serverless.start({"handler": handler, "concurrency_modifier": concurrency_modifier})


if __name__ == "__main__":
    # As `python -m preheat.server` ends: after the atexit handlers, without the interpreter's
    # finalisation, which aborted the worker ("FATAL: exception not rethrown", exit -6) when the
    # SDK's local test mode returned while an executable loaded from a warm cache had a thread
    # inside XLA.
    from preheat.hard_exit import run_and_exit

    run_and_exit(main)
