"""Dynamic batching: which waiting predictions run together, running them as one engine call,
splitting the pixels, and what a batch is measured to take.

A batch is the oldest waiting prediction plus every later one with its batch key
(``Job.batch_key``: sampler, steps, guidance scale, image size, whether negative prompts are given,
LoRA rank bucket) that still fits ``max_batch_size`` (:func:`collect`). :class:`Batcher` runs it as
one ``Pipeline.run`` padded to the next compiled bucket, encodes each prediction's images and
completes it through the core's ``finish`` (the prediction store is the core's).

Images are per-request exact: a request with ``seed=s`` and n images puts seeds s..s+n-1 in
the batch, and the engine draws every image's noise from its own seed only. Padding slots get
seed 0 / class 0 and are dropped. The same bucket size gives bit-identical pixels to
``pipe.generate(bucket, seed=<same list>)``; a different batch size may round differently in
XLA (rarely +-1 uint8 level).

Progress: every step of a batch adds ``step k/N`` to each member's logs and a "log" event; when
every member is canceled the step callback stops the call (``preheat.progress.Stop``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from typing import Any, Callable, Optional

from preheat.errors import SamplingStopped
from preheat.families import request as request_of
from preheat.progress import Stop
from preheat.server.config import CoreConfig
from preheat.server.metrics import CoreMetrics
from preheat.server.predictions import BatchRun, Prediction, call_listener
from preheat.warm import bucket_for

__all__ = ["Batcher", "Finish", "collect"]

log = logging.getLogger("preheat.server")

Finish = Callable[..., None]  # (prediction, status, output=, error=): the core completes a prediction


def collect(pending: list[Prediction], max_batch_size: int) -> tuple[list[Prediction], int]:
    """The head of ``pending`` plus every later prediction with its batch key that still fits
    ``max_batch_size`` images; returns them and their image count."""
    if not pending:
        return [], 0
    key = pending[0].job.batch_key
    batch, images = [], 0
    for p in pending:
        if p.job.batch_key == key and images + p.job.n <= max_batch_size:
            batch.append(p)
            images += p.job.n
            if images == max_batch_size:
                break
    return batch, images


class Batcher:
    """Runs collected batches on the worker thread and keeps what they took.

    ``lock`` is the core's: a prediction's fields are changed under it. ``finish`` completes a
    prediction (the core's store, metrics and listeners). ``clock`` times each batch (seconds,
    any origin): the core's, so a batch's measured length and the running one's elapsed time,
    which ``Retry-After`` subtracts, are read off one clock, and a test can drive it by hand."""

    def __init__(self, config: CoreConfig, metrics: CoreMetrics, lock: threading.Condition, finish: Finish,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.metrics = metrics
        self._lock = lock
        self._finish = finish
        self.clock = clock
        self._ids = itertools.count(1)
        self.stats = {"batches": 0, "images": 0, "padded": 0, "traffic_compiles": 0}
        # a batch key not run yet is expected to take fixed_s + its steps x seconds_per_step: an engine
        # call's cost apart from its steps (encoding, decoding, transfers, step reports) is counted
        # once, not once a step (warm-up's 1-step calls made a 20-step batch 2-5x too long)
        self.seconds_per_step: Optional[float] = None  # engine seconds per step (warm-up, then each batch)
        self.fixed_s = 0.0  # engine seconds per call whatever its steps (warm-up)
        # the running batch's key and its seconds per step so far (its step reports), while it runs:
        # a burst of a kind not finished yet is expected at the pace its first batch is running at
        self._pace: Optional[tuple[tuple, float]] = None
        # measured seconds of one engine call (encoding included), per batch key: what Retry-After reads
        self.batch_seconds: dict[tuple, float] = {}

    def batch_s(self, key: tuple) -> float:
        """What one batch of ``key`` is expected to take: what the last ones took; else, while a
        batch of it runs and reports its steps, the fixed cost plus its steps at that batch's pace;
        else the fixed cost plus its steps (``key[1]``) at ``seconds_per_step`` (1 s a step before
        anything was measured)."""
        if key in self.batch_seconds:
            return self.batch_seconds[key]
        pace = self._pace
        if pace is not None and pace[0] == key:
            return self.fixed_s + key[1] * pace[1]
        per_step = self.seconds_per_step if self.seconds_per_step is not None else 1.0
        return self.fixed_s + key[1] * per_step

    def run(self, pipe: Any, buckets: tuple[int, ...], batch: list[Prediction]) -> None:
        """Run ``batch`` as one engine call in the smallest of ``buckets`` that holds it, and
        complete every prediction in it (a failed call fails them all, never the server)."""
        job0 = batch[0].job
        images = sum(p.job.n for p in batch)
        bucket = bucket_for(buckets, images)
        pad = bucket - images
        batch_id = next(self._ids)
        t0 = self.clock()
        try:
            # the jobs' requests, validated at parse time, as one (padding repeats the first image)
            request = request_of.concat(pipe, [p.job.request for p in batch], pad)
            try:
                if self.config.progress and pipe.reports_progress:
                    pixels = pipe.run(request, progress=self._progress(batch, t0))
                else:
                    pixels = pipe.run(request)
            finally:
                self._pace = None  # measured from here on (batch_seconds), once it is not a compile
            compiled = pipe.last.cache_layer != "memory"
            run_s = self.clock() - t0
            outputs = []
            offset = 0
            from preheat.server.images import data_url

            for p in batch:
                outputs.append([data_url(pixels[offset + i], p.job.output_format) for i in range(p.job.n)])
                offset += p.job.n
        except SamplingStopped:  # every prediction of the batch was canceled: it ended within a step
            for p in batch:
                self._finish(p, "canceled")
            return
        except Exception as err:  # noqa: BLE001 - a failed batch fails its predictions, never the server
            log.error("batch %d failed\n%s", batch_id, traceback.format_exc())
            message = (str(err).splitlines() or [type(err).__name__])[0]
            for p in batch:
                self._finish(p, "failed", error=f"{type(err).__name__}: {message}")
            return
        took = self.clock() - t0
        stepping = took - self.fixed_s if took > self.fixed_s else took  # noise past the fixed cost: all of it
        per_step = stepping / max(1, job0.steps)
        self.seconds_per_step = per_step if self.seconds_per_step is None else 0.8 * self.seconds_per_step + 0.2 * per_step
        if not compiled:  # a compile is not what the next batch of this key will take
            last = self.batch_seconds.get(job0.batch_key)
            self.batch_seconds[job0.batch_key] = took if last is None else 0.5 * last + 0.5 * took
        m = self.metrics
        m.batches.inc()
        m.batch_images.observe(images)
        m.batch_requests.observe(len(batch))
        m.padded_images.inc(pad)
        m.batch_seconds.observe(took)
        self.stats["batches"] += 1
        self.stats["images"] += images
        self.stats["padded"] += pad
        if compiled:
            m.compiles.labels(phase="traffic").inc()
            self.stats["traffic_compiles"] += 1
        offset = 0
        for p, out in zip(batch, outputs):
            with self._lock:
                p.record_batch(BatchRun(batch_id, len(batch), images, bucket, job0.sampler, job0.steps, took, run_s,
                                        compiled, pipe.last.cache_layer), offset)
            offset += p.job.n
            if p.cancel_requested:
                self._finish(p, "canceled")
            else:
                self._finish(p, "succeeded", output=out)

    def _progress(self, batch: list[Prediction], t0: float) -> Callable[[int, int], None]:
        """The batch's step callback: a ``step k/N`` log line (as Cog models print) and a "log"
        event for every prediction in it, and the batch's pace so far (``batch_s``); when every
        one is canceled, the call ends (``Stop``)."""
        key = batch[0].job.batch_key

        def on_step(step: int, total: int) -> None:
            self._pace = (key, (self.clock() - t0) / max(1, step))  # what Retry-After reads while it runs
            line = f"step {step}/{total}"
            with self._lock:
                for p in batch:
                    p.logs.append(line)
                events = [(p.snapshot(), list(p._listeners)) for p in batch if not p.terminal]
                stop = all(p.cancel_requested or p.terminal for p in batch)
            for snap, listeners in events:
                for fn in listeners:
                    call_listener(fn, "log", snap)
            if stop:
                raise Stop(f"every prediction of the batch was canceled at step {step}/{total}")

        return on_step
