"""The batching core without HTTP: buckets, cancel while running, draining, failures."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from preheat.server.core import Core, CoreConfig, NotAccepting, buckets_for


class GatedPipe:
    """The real pipeline, but generate() waits for a gate (to hold a batch 'running')."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.gate.wait(60)
        if self.fail:
            raise RuntimeError("device lost\nsecond line")
        return self._pipe.generate(*args, **kwargs)


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
    gp.gate.clear()
    gp.entered.clear()
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
    gp.gate.clear()
    running, _ = core.submit(*core.parse({"seed": 1, "num_inference_steps": 2}))
    assert gp.entered.wait(30)
    waiting, _ = core.submit(*core.parse({"seed": 2, "num_inference_steps": 3}))  # another key: next batch
    core.begin_drain()
    assert core.status == "BUSY"
    with pytest.raises(NotAccepting):
        core.parse({"seed": 3})
    assert not core.wait_idle(0.2)
    gp.gate.set()
    assert core.wait_idle(60)
    assert running.status == waiting.status == "succeeded"


def test_close_fails_what_never_ran(pipe: Any) -> None:
    core = Core(CoreConfig(max_batch_size=1, batch_wait_ms=60_000), pipe=pipe).start()
    assert core.wait_setup(600)
    pred, _ = core.submit(*core.parse({"seed": 1}))
    pred2, _ = core.submit(*core.parse({"seed": 1, "num_inference_steps": 2}))
    core.close()
    assert pred2.status == "failed" and "shut down" in pred2.error


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
        assert np.abs(got.astype(int) - jax_pixels.astype(int)).mean() < 2.0
    finally:
        core.close()
