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
``scheduler``, ``seed``, ``output_format``, ``lora_weights`` (a path, http(s):// or hf:// LoRA)
and ``lora_scale`` (``preheat.server.inputs.parse_input``, the same parse as Cog's route).
The result is ``{"images": [data URLs], "seed": int, "metrics": {...}}``, or
``{"error": "<field>: <message>"}`` for bad input. ``handler`` is async, so with a concurrency
modifier > 1 the SDK runs several jobs at once and the core batches them into one engine call.

The engine is loaded once per process (at ``python -m`` start, or on the first job), from
``$PREHEAT_MODEL`` (default: the built-in model). Knobs: ``PREHEAT_MAX_BATCH_SIZE`` (8),
``PREHEAT_BATCH_WAIT_MS`` (10), ``PREHEAT_MAX_QUEUE`` (64), ``PREHEAT_MAX_STEPS`` (200),
``PREHEAT_SAMPLERS`` (comma-separated; default: the model's own, all compiled at start),
``PREHEAT_SIZES`` (text-to-image: ``512x512,768x512``; default: the model's size),
``PREHEAT_GUIDANCE`` (guidance modes warmed: ``off,on``, as ``preheat warm --guidance``),
``PREHEAT_LORA_RANKS`` (LoRA rank buckets warmed, as ``--lora-ranks``: ``16,32``),
``PREHEAT_MAX_LORAS`` (LoRAs held ready, 8),
``PREHEAT_LORA_DIR`` (the only folder a request's local ``lora_weights`` may name; unset: URLs
and ``hf://`` only), ``PREHEAT_MAX_IMAGE_PIXELS`` (width x height of a request's ``image`` /
``mask``, as ``--max-image-pixels``; default 4096²) and
``PREHEAT_DTYPE`` (float32; ``bfloat16`` for a GPU worker), ``PREHEAT_CONFIG`` (with a single
``.safetensors`` as ``PREHEAT_MODEL``: the diffusers folder or ``hf://`` repository whose configs
read it, as ``--config``), ``PREHEAT_VARIANT`` (``fp16``: weight files ``*.fp16.safetensors``),
``PREHEAT_WEIGHTS_DTYPE`` (``float8_e4m3fn``: the denoiser's weights stored in fp8) and
``PREHEAT_PROGRESS`` (``off``: programs without step progress, as ``serve --no-progress``). The
compile cache lives on the network volume automatically (``/runpod-volume/preheat``, see
``preheat.cache.root``), so a cold worker with a warm volume starts hot.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, Optional

from preheat.errors import InputError, InvalidArgumentError, MissingExtraError, NotAccepting, PreheatError, QueueFull

try:
    from preheat.server.core import Core, CoreConfig
    from preheat.server.inputs import parse_lora_ranks, parse_sizes
except ModuleNotFoundError as _err:  # python -m without the serve extra: one line, never a traceback
    if __name__ != "__main__" or MissingExtraError.of(_err, "the Runpod handler") is None:
        raise
    raise SystemExit(f"error: {MissingExtraError.of(_err, 'the Runpod handler')}") from None

__all__ = ["handler", "concurrency_modifier", "get_core", "config_from_env", "main"]

_core: Optional[Core] = None
_lock = threading.Lock()


def config_from_env(env: Optional[dict[str, str]] = None) -> CoreConfig:
    from preheat.env import on_off

    env = dict(os.environ if env is None else env)
    try:
        progress = on_off(env.get("PREHEAT_PROGRESS") or "on", "PREHEAT_PROGRESS")
    except ValueError as err:
        raise InvalidArgumentError(str(err), argument="PREHEAT_PROGRESS") from None

    def number(name: str, default: str, kind: type = int) -> Any:
        text = env.get(name) or default
        try:
            return kind(text)
        except ValueError:
            what = "an int" if kind is int else "a number"
            raise InvalidArgumentError(f"{name} {text!r} must be {what}", argument=name) from None

    return CoreConfig(model=env.get("PREHEAT_MODEL") or None, dtype=env.get("PREHEAT_DTYPE") or "float32",
                      config=env.get("PREHEAT_CONFIG") or None, variant=env.get("PREHEAT_VARIANT") or None,
                      weights_dtype=env.get("PREHEAT_WEIGHTS_DTYPE") or None, progress=progress,
                      sizes=parse_sizes(env.get("PREHEAT_SIZES")),
                      max_batch_size=number("PREHEAT_MAX_BATCH_SIZE", "8"),
                      batch_wait_ms=number("PREHEAT_BATCH_WAIT_MS", "10", float),
                      max_queue=number("PREHEAT_MAX_QUEUE", "64"),
                      max_steps=number("PREHEAT_MAX_STEPS", "200"),
                      max_loras=number("PREHEAT_MAX_LORAS", "8"), lora_dir=env.get("PREHEAT_LORA_DIR") or None,
                      max_image_pixels=number("PREHEAT_MAX_IMAGE_PIXELS", "0") or None,
                      lora_ranks=parse_lora_ranks(env.get("PREHEAT_LORA_RANKS"), "PREHEAT_LORA_RANKS"),
                      samplers=tuple(n.strip() for n in env.get("PREHEAT_SAMPLERS", "").split(",") if n.strip()),
                      guidance=tuple(g.strip() for g in (env.get("PREHEAT_GUIDANCE") or "off,on").split(",") if g.strip()))


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
    except InputError as err:
        return {"error": str(err)}
    except (QueueFull, NotAccepting) as err:
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
    main()
