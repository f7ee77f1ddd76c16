"""The batching core without HTTP: buckets, cancel while running, draining, failures, the
drain-time estimate. Batches are held with a GatedPipe or Core.pause, never a time window."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from preheat.errors import NotAccepting
from preheat.server.core import SHUT_DOWN, Core, CoreConfig, buckets_for
from tests._support.numerics import mean_abs_px
from tests._support.server_fixtures import GatedPipe


def _wait(pred: Any, status: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while pred.status != status:
        assert time.monotonic() < deadline, pred.status
        time.sleep(0.01)


def test_buckets() -> None:
    assert buckets_for(1) == (1,)
    assert buckets_for(8) == (1, 2, 4, 8)
    assert buckets_for(6) == (1, 2, 4, 6)
    with pytest.raises(ValueError):
        buckets_for(0)


@pytest.fixture
def gated(pipe: Any):
    gp = GatedPipe(pipe)
    core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=0), pipe=gp).start()
    assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
    yield core, gp
    gp.gate.set()
    core.close()


def test_cancel_while_running_drops_the_images(gated: Any) -> None:
    core, gp = gated
    gp.hold()
    job, given = core.parse({"seed": 1})
    pred, created = core.submit(job, given)
    assert created
    assert gp.entered.wait(30)
    _wait(pred, "processing")
    assert core.cancel(pred.id)
    assert pred.status == "processing"  # the engine call cannot be interrupted
    gp.gate.set()
    assert pred.done.wait(60)
    assert pred.status == "canceled" and pred.output is None


def test_engine_failure_fails_the_batch_not_the_server(gated: Any) -> None:
    core, gp = gated
    gp.fail = True
    job, given = core.parse({"seed": 1})
    pred, _ = core.submit(job, given)
    assert pred.done.wait(60)
    assert pred.status == "failed" and pred.error == "RuntimeError: device lost"
    gp.fail = False
    pred2, _ = core.submit(*core.parse({"seed": 2}))
    assert pred2.done.wait(60) and pred2.status == "succeeded"
    assert core.metrics.predictions.labels(status="failed")._value.get() == 1


def test_drain_finishes_accepted_work_and_refuses_new(gated: Any) -> None:
    core, gp = gated
    gp.hold()
    running, _ = core.submit(*core.parse({"seed": 1, "num_inference_steps": 2}))
    assert gp.entered.wait(30)
    waiting, _ = core.submit(*core.parse({"seed": 2, "num_inference_steps": 3}))  # another key: next batch
    core.begin_drain()
    assert core.status == "BUSY"
    with pytest.raises(NotAccepting):
        core.parse({"seed": 3})
    assert core.in_flight == 2  # held at the gate: both still accepted, neither done
    gp.gate.set()
    assert core.wait_idle(60)
    assert running.status == waiting.status == "succeeded"


def test_close_fails_what_never_ran(gated: Any) -> None:
    core, gp = gated  # max_batch_size=2: a different key keeps the second one out of the first batch
    gp.hold()
    first, _ = core.submit(*core.parse({"seed": 1}))
    assert gp.entered.wait(60)  # the first batch is running, held at the gate
    second, _ = core.submit(*core.parse({"seed": 1, "num_inference_steps": 2}))
    assert core.queue_depth == 1
    core.close(timeout=0)  # the worker is held: nothing can have taken the second one
    assert second.status == "failed" and second.error == SHUT_DOWN
    gp.gate.set()
    assert first.done.wait(60)
    assert first.status == "succeeded" and len(first.output) == 1  # the running batch finished


def test_drain_runs_a_partial_batch_at_once(pipe: Any) -> None:
    """While draining no batch-mate can arrive, so a prediction does not sit out its batch wait."""
    core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=3_600_000), pipe=pipe).start()
    try:
        assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
        pred, _ = core.submit(*core.parse({"seed": 1}))
        assert core.queue_depth == 1  # waiting an hour for a batch-mate
        core.begin_drain()
        assert pred.done.wait(60) and pred.status == "succeeded"
    finally:
        core.close()


def test_expected_drain_time_counts_steps_and_batches(pipe: Any) -> None:
    core = Core(CoreConfig(max_batch_size=2, max_steps=200, batch_wait_ms=0), pipe=pipe).start()
    try:
        assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
        assert core.batcher.seconds_per_step is not None and core.batcher.seconds_per_step > 0  # measured by warm-up
        assert core.batcher.fixed_s >= 0 and "; a batch of 2: " in core.setup.logs[-1] and "s a step" in core.setup.logs[-1]
        core.pause()
        core.batcher.fixed_s, core.batcher.seconds_per_step = 0.25, 0.125  # known costs: the sums below are exact
        assert core.expected_drain_s() == 0 and core.retry_after() == 1
        for seed in range(3):  # one key: 3 images -> 2 batches of 100 steps
            core.submit(*core.parse({"seed": seed, "num_inference_steps": 100}))
        core.submit(*core.parse({"seed": 9, "num_inference_steps": 8}))  # another key: 1 batch of 8 steps
        # each batch once its fixed cost, then its steps (not the fixed cost once a step)
        assert core.expected_drain_s() == 2 * (0.25 + 100 * 0.125) + (0.25 + 8 * 0.125)
        assert core.retry_after() == 27
        core.resume()
        assert core.wait_idle(120)
    finally:
        core.close()


def test_abandoned_prediction_is_canceled_only_while_queued(gated: Any) -> None:
    core, gp = gated
    gp.hold()
    running, _ = core.submit(*core.parse({"seed": 1}))
    assert gp.entered.wait(60)
    queued, _ = core.submit(*core.parse({"seed": 2, "num_inference_steps": 2}))
    shared, _ = core.submit(*core.parse({"seed": 3, "num_inference_steps": 3}))
    kept, _ = core.submit(*core.parse({"seed": 4, "num_inference_steps": 5}), respond_async=True)
    for p in (running, queued, shared, kept):
        core.watch(p)
    core.watch(shared)  # a second client (an idempotent retry) waits for it too
    assert not core.abandon(running)  # running: it finishes
    assert core.abandon(queued) and queued.status == "canceled"
    assert not core.abandon(shared) and shared.status == "starting"  # someone still waits
    assert not core.abandon(kept)  # answered 202 at once: its result goes to GET / the webhook
    assert core.queue_depth == 2
    gp.gate.set()
    assert core.wait_idle(120)
    assert running.status == shared.status == kept.status == "succeeded"


def test_torch_backend_serves_through_the_same_core(model_dir: Any, pipe: Any) -> None:
    """--backend torch: diffusers' UNet and schedulers behind the same parsing and batching."""
    core = Core(CoreConfig(model=str(model_dir), backend="torch", max_batch_size=2, batch_wait_ms=0)).start()
    try:
        assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
        assert type(core.pipe).__name__ == "TorchPipeline"
        pred, _ = core.submit(*core.parse({"seed": 3, "class_label": 5, "num_outputs": 2}))
        assert pred.done.wait(120) and pred.status == "succeeded", pred.error
        from preheat.server.images import decode_data_url

        got = np.stack([decode_data_url(u) for u in pred.output])
        jax_pixels = pipe.generate(2, class_labels=5, seed=3)
        # Same checkpoint, same initial noise, diffusers' float32 math vs preheat's: close, not bit-equal.
        assert mean_abs_px(got, jax_pixels) < 2.0
    finally:
        core.close()


def test_every_prediction_of_a_batch_gets_every_step(pipe: Any) -> None:
    """Step progress fans out: two requests batched into one engine call each get a "log" event and
    a ``step k/N`` log line for every step of that call."""
    steps = 3
    core = Core(CoreConfig(max_batch_size=2, batch_wait_ms=0), pipe=pipe).start()
    try:
        assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
        core.pause()  # both queued before the worker collects: one batch of two
        preds = [core.submit(*core.parse({"seed": s, "num_inference_steps": steps}))[0] for s in (1, 2)]
        seen: dict[str, list[str]] = {p.id: [] for p in preds}
        for p in preds:
            core.subscribe(p, lambda event, snap: seen[snap["id"]].append(event))
        core.resume()
        assert all(p.done.wait(60) and p.status == "succeeded" for p in preds)
        assert [p.metrics["batch_requests"] for p in preds] == [2, 2]
        assert preds[0].metrics["batch_id"] == preds[1].metrics["batch_id"]
        for p in preds:
            assert seen[p.id].count("log") == steps and seen[p.id][-1] == "completed", seen[p.id]
            assert [line for line in p.logs if line.startswith("step ")] == [f"step {k}/{steps}"
                                                                               for k in range(1, steps + 1)]
    finally:
        core.close()
