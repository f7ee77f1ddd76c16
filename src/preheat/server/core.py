"""The one core behind every surface: set-up (load + warm-up), predictions, dynamic batching.

Threads: ONE worker thread owns the model. It loads the pipeline, compiles every program a
request can reach (``preheat.server.warmup``), then loops: take the oldest waiting prediction,
wait up to ``batch_wait_ms`` (counted from that prediction's arrival) for others with the same
batch key, run them as one engine call padded to the next compiled bucket, split the pixels,
encode, complete (``preheat.server.batching``: which predictions batch together, and the run).
Callers (HTTP routes, the Runpod handler) only parse, enqueue and wait; they are told about
progress through listeners called from the worker thread. Samplers and inputs that warm-up did
not compile are refused at parse time, so traffic never compiles.

Cancelling: a waiting prediction is dropped at once (its slot frees); a running batch ends at
its next step once every member is canceled (the step callback stops it: ``preheat.progress``),
else it finishes and a canceled member's images are dropped. A client that goes away
(:meth:`Core.abandon`) cancels its prediction while it is still waiting (a stream's, running too).

Idle retune (``retune_idle_s``; on a GPU only): executables the warm-up loaded from entries that
were compiled without autotuning (``preheat warm --target``) are compiled again, autotuned, on a
thread of their own once the server has been idle that long; the worker then takes the timed
calls that compare the two one at a time, only while no prediction waits, and swaps the faster
one in between batches (``preheat.cache.retune.IdleRetuner``).
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
import traceback
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable, Optional

from preheat.errors import InputError, NotAccepting, PreheatError, QueueFull
from preheat.server.batching import Batcher, collect
from preheat.server.fetch import FetchConfig, Fetcher
from preheat.server.warmup import warm_up
from preheat.warm import WarmSignature, buckets_for, resolve, signatures
from preheat.server.inputs import FamilyInputs, Job, Limits, family_inputs, image_urls, input_model, parse_input
from preheat.server.config import CoreConfig, load_pipeline
from preheat.server.metrics import CoreMetrics, FetchMetrics
from preheat.store import is_remote
from preheat.server.predictions import Listener, Prediction, SetupInfo, call_listener
from preheat.timings import now_iso

__all__ = ["CoreConfig", "Core", "Prediction", "buckets_for", "SHUT_DOWN"]

log = logging.getLogger("preheat.server")

SHUT_DOWN = "the server shut down before this prediction finished"  # the error of predictions dropped by close()


class Core:
    """Set-up, the bounded queue, the batching worker and the prediction store.

    ``clock`` (seconds, any origin) times the batches and the running one's elapsed time: what
    ``Retry-After`` is computed from, so a test can drive it by hand and get exact answers. Batch
    waits, queue waits and the idle retune keep real time (a clock held still never stalls them)."""

    def __init__(self, config: CoreConfig, pipe: Any = None,
                 loader: Callable[[CoreConfig], Any] = load_pipeline,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        config.check()
        self.config = config
        if config.max_image_pixels is not None:  # the process's limit (and PIL's bomb limit): set before any request
            from preheat.image_input import set_max_pixels

            set_max_pixels(config.max_image_pixels)
        self.metrics = CoreMetrics()
        fetch = config.fetch if config.fetch is not None else FetchConfig()
        self.fetcher = Fetcher(replace(fetch, policy=config.lora_urls) if config.lora_urls is not None else fetch,
                               FetchMetrics(self.metrics.registry))
        self.limits = Limits(max_batch_size=config.max_batch_size, max_steps=config.max_steps,
                             max_guidance=config.max_guidance, schedulers=tuple(config.samplers),
                             sizes=tuple(config.sizes), lora_dir=config.lora_dir, fetcher=self.fetcher)
        self.input_model = input_model(self.limits)
        self.buckets = buckets_for(config.max_batch_size, pipe.device_count if pipe is not None else 1)
        self.setup = SetupInfo()
        self.pipe = pipe
        self._loader = loader
        self._cond = threading.Condition()
        self._pending: list[Prediction] = []
        self._running: list[Prediction] = []
        self._store: "OrderedDict[str, Prediction]" = OrderedDict()
        self._setup_done = threading.Event()
        self._setup_listeners: list[Callable[[], None]] = []  # serve: exit on a set-up failure
        self.closing_pushes = threading.Event()  # set when close() starts waiting for uploads
        self.warm = config.warm_set()  # resolved at set-up (the model's default sampler, sizes)
        self._draining = False
        self._stopping = False
        self._paused = False
        self.clock = clock
        self._running_since = 0.0  # on ``clock``: when the running batch started
        self.samplers: tuple[str, ...] = tuple(config.samplers)  # resolved at set-up: what is offered
        # runs the batches; keeps their stats and what they took (seconds_per_step, batch_seconds)
        self.batcher = Batcher(config, self.metrics, self._cond, self._finish, clock=clock)
        self._thread: Optional[threading.Thread] = None
        self._died: Optional[str] = None  # why the worker thread died after set-up (DEFUNCT)
        self._idle_since = time.monotonic()  # when the last batch ended (or set-up did)
        # the idle retune of not-autotuned entries (None: off, or this backend does not autotune)
        self.retuner: Any = None
        if config.retune_idle_s is not None:
            from preheat.cache.retune import IdleRetuner

            self.retuner = IdleRetuner(config.retune_idle_s, self._cond)
            self.retuner.on_outcome = lambda outcome: self.metrics.retunes.labels(outcome=outcome).inc()

    @property
    def defunct(self) -> Optional[str]:
        """Why the worker thread is gone while the server still runs (None while it serves)."""
        if self._died is not None:
            return self._died
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stopping and self._setup_done.is_set():
            return "the worker thread exited"
        return None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Core":
        """Start the worker thread: set-up (load, warm-up), then serve. Returns at once."""
        if self._thread is None:
            self.setup.started_at = now_iso()
            self._thread = threading.Thread(target=self._main, name="preheat-worker", daemon=True)
            self._thread.start()
        return self

    def wait_setup(self, timeout: Optional[float] = None) -> bool:
        """Block until set-up finished (either way); False on timeout."""
        return self._setup_done.wait(timeout)

    @property
    def status(self) -> str:
        """Cog's health states: STARTING, READY, BUSY (queue full or draining), SETUP_FAILED, and
        DEFUNCT when the worker thread has died (nothing will run: a load balancer replaces the pod)."""
        if self.setup.status == "failed":
            return "SETUP_FAILED"
        if self.setup.status != "succeeded":
            return "STARTING"
        if self.defunct is not None:
            return "DEFUNCT"
        if self._draining or len(self._pending) >= self.config.max_queue:
            return "BUSY"
        return "READY"

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._pending) + len(self._running)

    def begin_drain(self) -> None:
        """Refuse new predictions from now on; accepted ones still run. A pending retune is dropped."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()
        retuner = self.retuner  # set-up may switch it off (None) meanwhile
        if retuner is not None:
            retuner.cancel()

    def pause(self) -> None:
        """Hold the worker: predictions queue up, none starts until :meth:`resume` (tests,
        maintenance), and the idle retune starts no compile and takes no timed call (one compile
        already running finishes on its own thread). A batch already being collected or running
        is not affected."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        """Let the worker go on; the idle retune's clock starts again now (a pause is not a lull)."""
        with self._cond:
            self._paused = False
            if not self._running:
                self._idle_since = time.monotonic()
            self._cond.notify_all()

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until no prediction is waiting or running; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._running, timeout)

    def abort_running(self) -> int:
        """Fail the predictions of the running batch now, as close() fails the queued ones (a
        shutdown cut short); their batch's images, when it returns, are dropped. Returns how many."""
        with self._cond:
            self._draining = True
            running = [p for p in self._running if not p.terminal]
        for p in running:
            self._finish(p, "failed", error=SHUT_DOWN)
        return len(running)

    def close(self, timeout: float = 5.0, wait_pushes: bool = True) -> None:
        """Stop the worker; predictions still waiting fail with a one-line error. ``wait_pushes``:
        give background uploads to the shared store ``push_grace_s`` (not when cut short)."""
        with self._cond:
            self._draining = True
            self._stopping = True
            left, self._pending = self._pending, []
            self._cond.notify_all()
        for p in left:
            self._finish(p, "failed", error=SHUT_DOWN)
        retuner = self.retuner  # set-up may switch it off (None) meanwhile
        if retuner is not None:
            retuner.cancel()
        self.fetcher.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.closing_pushes.set()
        compiler = self.pipe.compiler if self.pipe is not None else None
        if wait_pushes and compiler is not None and getattr(compiler, "background", None) is not None:
            left = compiler.background.pending
            if left:
                log.info("waiting up to %.0fs for %d upload(s) to the shared cache", self.config.push_grace_s, left)
            compiler.wait_pushes(self.config.push_grace_s)

    @property
    def pending_pushes(self) -> int:
        """Uploads to the shared store queued or running (background, after compiles)."""
        compiler = self.pipe.compiler if self.pipe is not None else None
        background = getattr(compiler, "background", None)  # the torch compiler pushes nothing in the background
        return 0 if background is None else background.pending

    # ------------------------------------------------------------------ requests

    def parse(self, raw: Any) -> tuple[Job, dict[str, Any]]:
        """Validate a Cog-style input (dict or ``self.input_model``); raises ``InputError``/``NotAccepting``."""
        self._check_accepting()
        return parse_input(raw, self.pipe, self.limits, self.input_model)

    async def parse_async(self, raw: Any, inputs: Optional[FamilyInputs] = None) -> tuple[Job, dict[str, Any]]:
        """:meth:`parse` for a coroutine: in a worker thread when the input names a LoRA or an image,
        whose first read (a download, a large file, decoding) must not hold up the event loop.
        Image URLs are fetched first, each on the fetcher's own threads (``Fetcher.image``).
        ``inputs``: :meth:`family_inputs`, when the route has read them for this request already."""
        source = raw.get("lora_weights") if isinstance(raw, dict) else getattr(raw, "lora_weights", None)
        if inputs is None:
            inputs = self.family_inputs()  # read once for this request: its image fields, then its parse
        images = self._image_fields(raw, inputs)
        if not source and not images:
            self._check_accepting()
            return parse_input(raw, self.pipe, self.limits, self.input_model, inputs=inputs)
        import asyncio

        self._check_accepting()
        loop = asyncio.get_running_loop()
        source = str(source or "").strip()
        if source and is_remote(source) and not await asyncio.to_thread(self.fetcher.stored, source):
            # the download on the fetcher's own threads: stalled hosts never hold the threads that
            # read local files and stored entries. A refusal is an error on lora_weights (parse's).
            try:
                await loop.run_in_executor(self.fetcher.pool, self.fetcher.lora, source)
            except PreheatError as err:
                raise InputError([("lora_weights", (str(err).splitlines() or [type(err).__name__])[0])]) from None
        fetched: dict[str, bytes] = {}
        urls = {url: field for field, url in image_urls(images, raw).items()}
        reads = [loop.run_in_executor(self.fetcher.pool, self.fetcher.image, url) for url in urls]
        errors = []
        for url, result in zip(urls, await asyncio.gather(*reads, return_exceptions=True)):
            if isinstance(result, PreheatError):
                errors.append((urls[url], (str(result).splitlines() or [type(result).__name__])[0]))
            elif isinstance(result, BaseException):
                raise result
            else:
                fetched[url] = result
        if errors:
            raise InputError(errors)
        return await asyncio.to_thread(self._parse_fetched, raw, fetched, inputs)

    def family_inputs(self) -> Optional[FamilyInputs]:
        """The served family's declared and offered inputs (None before set-up has succeeded)."""
        if self.pipe is None or self.setup.status != "succeeded":
            return None
        return family_inputs(self.pipe, self.limits)

    def _image_fields(self, raw: Any, inputs: Optional[FamilyInputs]) -> tuple[Any, ...]:
        """The served family's image specs (``Image`` inputs) this input gives a value for."""
        if inputs is None:
            return ()
        from preheat.families.inputs import Image

        extra = raw if isinstance(raw, dict) else (getattr(raw, "model_extra", None) or {})
        return tuple(s for s in inputs.offered  # one not offered is refused, never fetched
                     if isinstance(s.type, Image) and extra.get(s.surface_name) is not None)

    def _parse_fetched(self, raw: Any, fetched: dict[str, bytes],
                       inputs: Optional[FamilyInputs]) -> tuple[Job, dict[str, Any]]:
        self._check_accepting()
        return parse_input(raw, self.pipe, self.limits, self.input_model, fetched, inputs)

    def _check_accepting(self) -> None:
        if self.setup.status == "succeeded" and self.defunct is not None:
            raise NotAccepting("defunct", f"the worker thread died ({self.defunct}); this server cannot run predictions")
        if self._draining:
            raise NotAccepting("draining", "the server is shutting down; not accepting predictions")
        if self.setup.status == "failed":
            raise NotAccepting("setup_failed", f"set-up failed: {self.setup.error}")
        if self.setup.status != "succeeded":
            raise NotAccepting("starting", "the model is still warming up; retry shortly (see /health-check)")

    def get(self, prediction_id: str) -> Optional[Prediction]:
        with self._cond:
            return self._store.get(prediction_id)

    def snapshot(self, pred: Prediction) -> dict[str, Any]:
        """A consistent copy of the prediction's public state (the worker mutates it under the lock)."""
        with self._cond:
            return pred.snapshot()

    def submit(self, job: Job, given: dict[str, Any], prediction_id: Optional[str] = None,
               listener: Optional[Listener] = None, extra: Optional[dict[str, Any]] = None,
               created_at: Optional[str] = None, respond_async: bool = False) -> tuple[Prediction, bool]:
        """Enqueue a prediction. Returns ``(prediction, created)``; when ``prediction_id`` is already
        known, the existing prediction is returned with ``created=False`` (idempotent retries; use
        :meth:`subscribe` to follow it). Raises ``QueueFull`` or ``NotAccepting``."""
        with self._cond:
            if prediction_id is not None and prediction_id in self._store:
                existing = self._store[prediction_id]
            else:
                existing = None
                self._check_accepting()
                if len(self._pending) >= self.config.max_queue:
                    raise QueueFull(len(self._pending), self.retry_after())
                pred = Prediction(id=prediction_id or secrets.token_hex(13), job=job, input=given, extra=extra or {},
                                  created_at=created_at or now_iso(), respond_async=respond_async)
                pred.logs.append(f"Using seed: {job.seed}")
                if listener is not None:
                    pred._listeners.append(listener)
                self._store[pred.id] = pred
                self._pending.append(pred)
                self.metrics.queue_depth.set(len(self._pending))
                self._evict()
                self._cond.notify_all()
        if existing is not None:  # the caller's listener is not attached: the first request owns the events
            return existing, False
        return pred, True

    def subscribe(self, pred: Prediction, listener: Listener) -> None:
        """Attach a listener; if ``pred`` already finished it is called now with "completed"."""
        with self._cond:
            if not pred.terminal:
                pred._listeners.append(listener)
                return
            snap = pred.snapshot()
        call_listener(listener, "completed", snap)

    def cancel(self, prediction_id: str) -> bool:
        """Cancel a prediction: a waiting one at once, a running one when its batch returns (its
        images are dropped). False when the id is unknown."""
        with self._cond:
            pred = self._store.get(prediction_id)
            if pred is None:
                return False
            if pred.terminal:
                return True
            pred.cancel_requested = True
            waiting = pred in self._pending
            if waiting:
                self._pending.remove(pred)
                self.metrics.queue_depth.set(len(self._pending))
                self._cond.notify_all()
        if waiting:
            self._finish(pred, "canceled")
        return True

    def same_request(self, pred: Prediction, raw: Any) -> bool:
        """Whether ``raw`` (a retry's input) asks for what ``pred`` computes: equal after parsing,
        so spelled-out defaults (``num_outputs: 1``, the model's steps) match an absent field.
        Raises ``InputError`` for invalid input."""
        job, _ = parse_input(raw, self.pipe, self.limits, self.input_model)
        given = raw.model_dump(exclude_unset=True) if hasattr(raw, "model_dump") else dict(raw)
        if "seed" not in given and "seed" not in pred.input:  # both random: the first one's stands
            job = replace(job, seed=pred.job.seed)
        return job == pred.job

    def watch(self, pred: Prediction) -> None:
        """A client now holds a connection open for ``pred``'s result."""
        with self._cond:
            pred.waiters += 1

    def unwatch(self, pred: Prediction) -> None:
        with self._cond:
            pred.waiters -= 1

    def abandon(self, pred: Prediction, running: bool = False) -> bool:
        """A client waiting for ``pred`` went away. When nobody else waits for it and it was not
        submitted asynchronously, a prediction that is still queued is canceled and its slot freed
        (True); a running one finishes, unless ``running`` (a stream's client): then it is
        canceled too, and a batch whose predictions are all canceled ends at its next step.
        Returns whether it was canceled."""
        with self._cond:
            pred.waiters -= 1
            if pred.waiters > 0 or pred.respond_async or pred.terminal:
                return False
            if pred not in self._pending and not (running and pred in self._running):
                return False
        log.info("prediction %s: the client went away; canceled while queued", pred.id)
        self.cancel(pred.id)
        return True

    def expected_drain_s(self) -> float:
        """Seconds until the work now accepted is done: what is left of the running batch plus every
        queued prediction, batched as the worker will batch it. A batch takes what the last ones
        of its key took (measured, fixed costs such as encoding included); a key not run yet, its
        steps at the measured seconds per step (``Batcher.batch_s``)."""
        batch_s = self.batcher.batch_s
        with self._cond:
            total = 0.0
            if self._running:
                left = batch_s(self._running[0].job.batch_key) - (self.clock() - self._running_since)
                total += max(0.0, left)
            images: dict[tuple, int] = {}
            for p in self._pending:
                images[p.job.batch_key] = images.get(p.job.batch_key, 0) + p.job.n
            for key, count in images.items():
                total += math.ceil(count / self.config.max_batch_size) * batch_s(key)
        return total

    def retry_after(self) -> int:
        """``Retry-After`` seconds for a refused request: the expected drain time, at least 1."""
        return max(1, math.ceil(self.expected_drain_s()))

    def _evict(self) -> None:
        finished = [k for k, p in self._store.items() if p.terminal]
        for k in finished[: max(0, len(finished) - self.config.keep_finished)]:
            del self._store[k]

    # ------------------------------------------------------------------ the worker thread

    def _main(self) -> None:
        try:
            self._do_setup()
        except BaseException as err:  # noqa: BLE001 - every set-up failure is reported, never raised
            from preheat.errors import PreheatError

            message = (str(err).splitlines() or [type(err).__name__])[0]
            if not isinstance(err, PreheatError):  # ours are one-line and self-explanatory
                log.error("set-up failed\n%s", traceback.format_exc())
                message = f"{type(err).__name__}: {message}"
            self.setup.error = message
            self.setup.logs.append(f"set-up failed: {message}")
            self.setup.status = "failed"
            self.setup.completed_at = now_iso()
            self._fire_setup()
            return
        self.setup.status = "succeeded"
        self.setup.completed_at = now_iso()
        self.metrics.ready.set(1)
        self._fire_setup()
        try:
            self._serve()
        except BaseException as err:  # noqa: BLE001 - recorded (DEFUNCT, logged), its predictions failed
            self._died = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}".rstrip(": ")
            log.error("the worker thread died\n%s", traceback.format_exc())
            self.metrics.ready.set(0)
            with self._cond:
                left = [p for p in self._store.values() if not p.terminal]  # queued and the batch it died in
                self._pending = []
            for p in left:
                self._finish(p, "failed", error=f"the worker thread died: {self._died}")

    def on_setup(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (from the worker thread, or now) once set-up has finished either way."""
        with self._cond:
            if not self._setup_done.is_set():
                self._setup_listeners.append(fn)
                return
        fn()

    def _fire_setup(self) -> None:
        with self._cond:
            self._setup_done.set()
            listeners, self._setup_listeners = self._setup_listeners, []
        for fn in listeners:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a listener's failure must not kill the worker
                log.exception("set-up listener failed")

    def _setup_log(self, line: str) -> None:
        self.setup.logs.append(line)
        log.info("%s", line)

    def _do_setup(self) -> None:
        start = time.perf_counter()
        if self.pipe is None:
            self._setup_log(f"loading model {self.config.model or 'built-in'} ({self.config.backend})")
            self.pipe = self._loader(self.config)
        pipe = self.pipe
        self.buckets = buckets_for(self.config.max_batch_size, pipe.device_count)
        self._setup_log(f"model loaded in {time.perf_counter() - start:.2f}s; image {pipe.sample_shape}, "
                        f"classes {pipe.num_classes}, defaults {pipe.defaults}")
        default_steps = int(pipe.defaults["steps"])
        if default_steps > self.limits.max_steps:
            self._setup_log(f"warning: the model's default {default_steps} steps exceed {self.config.names.max_steps} "
                            f"{self.limits.max_steps}; requests must then give num_inference_steps")
        if pipe.lora_runtime is not None:  # this server's LRU of LoRAs
            pipe.lora_runtime.hold(max_loras=self.config.max_loras)
            self.metrics.watch_loras(pipe.lora_runtime)
        compiler = pipe.compiler
        if compiler is not None and hasattr(compiler, "defer_pushes"):
            compiler.defer_pushes()  # uploads never hold up READY or a request
        self._prepare_retune(pipe)
        # refuses an unusable --sizes entry before READY, in one line naming it as it was given
        self.warm = resolve(pipe, self.warm, self.config.names)
        self.samplers = self.warm.samplers
        self.limits = replace(self.limits, sizes=self.warm.sizes)  # () where the model makes its own size only
        self.limits = replace(self.limits, schedulers=self.samplers)  # parse refuses the others, naming these
        self.limits = replace(self.limits, inputs=self.warm.inputs)  # ... and the inputs it does not offer
        self.limits = replace(self.limits, input_values=self.warm.input_values)  # ... and static values not warmed
        cost = warm_up(pipe, self.signatures(), self.buckets[-1], self.metrics, self._setup_log)
        if cost is not None:  # nothing has run before warm-up: this is the first estimate
            self.batcher.fixed_s, self.batcher.seconds_per_step = cost
        if compiler is not None and hasattr(compiler, "push_missing"):
            compiler.push_missing()  # local entries the store lacks (queued: READY does not wait)
        total = time.perf_counter() - start
        self.metrics.setup_seconds.set(total)
        if self.retuner is not None and self.retuner.waiting:
            self._setup_log(f"{self.retuner.waiting} executable(s) served from entries compiled without autotuning; "
                            f"each is retuned after {self.config.retune_idle_s:g}s idle")
        per_call = ("" if cost is None else f"; a batch of {self.buckets[-1]}: {cost.fixed_s:.3f}s + "
                    f"{cost.per_step_s:.3f}s a step")  # what Retry-After expects of a kind not run yet
        self._setup_log(f"ready in {total:.2f}s; buckets {list(self.buckets)}; samplers {list(self.samplers)}{per_call}")

    def _prepare_retune(self, pipe: Any) -> None:
        """Before warm-up: the idle retune collects what warm-up serves from not-autotuned
        entries (``IdleRetuner.attach``); off where this backend has nothing to retune."""
        if self.retuner is None:
            return
        if not self.retuner.attach(pipe):
            self.retuner = None
            return
        self.metrics.watch_retune(self.retuner)

    def signatures(self) -> list[WarmSignature]:
        """Every program a valid request can reach (``preheat.warm.signatures`` of the
        resolved declaration): what warm-up compiles and ``preheat warm`` compiles ahead of time."""
        return signatures(self.pipe, self.warm)

    def _serve(self) -> None:
        wait_s = self.config.batch_wait_ms / 1000.0
        self._idle_since = time.monotonic()
        while True:
            task = None
            with self._cond:
                while (not self._pending or self._paused) and not self._stopping:
                    task = self._idle_task()
                    if task is not None:
                        break
                    self._cond.wait(self._idle_wait())
                if self._stopping:
                    return
            if task is not None:  # one timed call of a retune (or its decision): a request waits behind it at most
                task()
                continue
            with self._cond:
                if (not self._pending or self._paused) or self._stopping:
                    continue
                while True:
                    batch, images = collect(self._pending, self.config.max_batch_size)
                    if not batch:  # the head was canceled while we waited
                        break
                    remaining = batch[0].enqueued + wait_s - time.monotonic()
                    # draining: no batch-mate can arrive any more, so run what is there now
                    if images >= self.config.max_batch_size or remaining <= 0 or self._stopping or self._draining:
                        break
                    self._cond.wait(remaining)
                if not batch:
                    continue
                for p in batch:
                    self._pending.remove(p)
                    p.status = "processing"
                    p.started_at = now_iso()
                    p.metrics["queue_wait"] = time.monotonic() - p.enqueued
                self._running = batch
                self._running_since = self.clock()
                self.metrics.queue_depth.set(len(self._pending))
                self.metrics.running.set(len(batch))
                snaps = [(p, p.snapshot(), list(p._listeners)) for p in batch]
            for _, snap, listeners in snaps:
                for fn in listeners:
                    call_listener(fn, "start", snap)
            try:
                self.batcher.run(self.pipe, self.buckets, batch)
            finally:
                with self._cond:
                    self._running = []
                    self._idle_since = time.monotonic()
                    self.metrics.running.set(0)
                    self._cond.notify_all()

    def _retune_may_run(self) -> bool:
        """With the lock held: an idle retune exists and nothing holds the worker (no prediction
        waiting, no drain, no pause)."""
        return self.retuner is not None and not (self._pending or self._draining or self._paused)

    def _idle_task(self) -> Optional[Callable[[], None]]:
        """With the lock held: the retune's next job when no prediction waits and the core is not
        paused (None: nothing to do)."""
        if not self._retune_may_run():
            return None
        return self.retuner.next_task(time.monotonic() - self._idle_since)

    def _idle_wait(self) -> Optional[float]:
        """How long the worker may sleep before the retune's idle time is up (None: until notified)."""
        if not self._retune_may_run():
            return None  # resume, a request or a drain notifies
        return self.retuner.wait_s(time.monotonic() - self._idle_since)

    def _finish(self, p: Prediction, status: str, output: Any = None, error: Optional[str] = None) -> None:
        with self._cond:
            if p.terminal:
                return
            p.status = status
            p.output = output
            p.error = error
            if error:
                p.logs.append(f"error: {error}")
            p.completed_at = now_iso()
            if "predict_time" not in p.metrics and p.started_at is not None:
                p.metrics["predict_time"] = 0.0
            listeners, p._listeners = p._listeners, []
            snap = p.snapshot()
            self._evict()
        self.metrics.predictions.labels(status=status).inc()
        p.done.set()
        for fn in listeners:
            call_listener(fn, "completed", snap)


__all__ += ["InputError", "SetupInfo", "load_pipeline"]
