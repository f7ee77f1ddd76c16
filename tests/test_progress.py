"""Step progress from inside the compiled loop (``preheat.progress``), on the built-in model:
every step once, in order, per call; unchanged pixels; through the AOT cache and over devices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import preheat
from preheat import progress
from preheat.cache.compile import JaxCompiler
from preheat.errors import SamplingStopped
from tests._support.threads import run_together


@pytest.fixture(scope="module")
def pipe() -> Any:
    return preheat.load(None, cache="off")


def test_each_step_is_reported_once_in_order_and_the_pixels_do_not_change(pipe: Any) -> None:
    seen: list[tuple[int, int]] = []
    plain = pipe.generate(2, seed=[4, 5], steps=5)
    reported = pipe.generate(2, seed=[4, 5], steps=5, progress=lambda s, t: seen.append((s, t)))
    assert seen == [(k, 5) for k in range(1, 6)]
    np.testing.assert_array_equal(reported, plain)
    assert not list(progress.iter_active())  # the registration ends with its call


def test_concurrent_calls_see_only_their_own_steps(pipe: Any) -> None:
    pipe.generate(1, seed=0, steps=3, progress=progress.ignore)  # compiled once, shared below
    seen: dict[int, list[tuple[int, int]]] = {3: [], 7: []}

    def call(steps: int) -> None:
        for _ in range(3):
            pipe.generate(1, seed=steps, steps=steps, progress=lambda s, t: seen[steps].append((s, t)))

    errors = run_together(call, seen, timeout_s=300)
    assert not errors
    for steps, got in seen.items():
        assert got == [(k, steps) for k in range(1, steps + 1)] * 3


def test_a_callback_that_raises_stop_ends_the_call(pipe: Any) -> None:
    seen: list[int] = []

    def stop_at_2(step: int, total: int) -> None:
        seen.append(step)
        if step == 2:
            raise progress.Stop()

    with pytest.raises(SamplingStopped):
        pipe.generate(1, seed=0, steps=8, progress=stop_at_2)
    assert seen == [1, 2]
    assert pipe.generate(1, seed=0, steps=2).shape[0] == 1  # the runtime is fine afterwards


def test_an_executable_loaded_from_the_aot_cache_still_reports(tmp_path: Path) -> None:
    first = preheat.load(None, cache="off")
    first.compiler = JaxCompiler(root=tmp_path, mode="full", remote=None)
    first.generate(1, seed=1, steps=3, progress=progress.ignore)
    assert first.last.cache_layer == "none"
    second = preheat.load(None, cache="off")  # its own (empty) in-memory table
    second.compiler = JaxCompiler(root=tmp_path, mode="full", remote=None)
    seen: list[tuple[int, int]] = []
    out = second.generate(1, seed=1, steps=4, progress=lambda s, t: seen.append((s, t)))
    assert second.last.cache_layer == "aot"
    assert seen == [(k, 4) for k in range(1, 5)]
    np.testing.assert_array_equal(out, second.generate(1, seed=1, steps=4))


def test_over_several_devices_each_step_is_reported_once() -> None:
    import jax

    if len(jax.devices()) < 2:
        pytest.skip("needs the suite's fake CPU devices")
    mesh_pipe = preheat.load(None, devices=2, cache="off")
    seen: list[tuple[int, int]] = []
    out = mesh_pipe.generate(4, seed=[0, 1, 2, 3], steps=3, progress=lambda s, t: seen.append((s, t)))
    assert seen == [(1, 3), (2, 3), (3, 3)]
    np.testing.assert_array_equal(out, mesh_pipe.generate(4, seed=[0, 1, 2, 3], steps=3))
