"""Which cases of a parametrized grid ``make test`` runs, and which only ``make test-slow`` (CI runs
both): the whole product of a grid's axes is the reference, and the developer's suite keeps a
subset in which every two values of any two axes still meet at least once.

``covering_marks(*positions)`` is the marks of one case, given its position on each axis: none
where the positions sum to 0 modulo ``mod``, else ``slow``. For two axes A and B, each pair
(a, b) is kept once some other axis offers the position that brings the sum to 0: so every pair
is covered as long as each case has, besides any two axes, one more with at least ``mod`` values.
That keeps 1/``mod`` of the product (3: a third).

``gpu_only`` marks a test of a GPU-only path, which ``make test-slow`` runs."""

from __future__ import annotations

import pytest

__all__ = ["covering_marks", "gpu_only"]

gpu_only = pytest.mark.slow
"""A test of what only a GPU runs -- a deviceless CUDA compile for a target GPU (jax-cuda's plugin
compiling for a described H200 on this CPU), cuDNN's calls, autotune-and-replace (retune: XLA:CPU
never autotunes, so the tests inject the GPU's trigger and timings) -- runs in ``make test-slow``
(CI runs it): a developer's ``make test`` on a CPU keeps the CPU's paths, and the shared code under
them (keys, entries, the CLI's one-line errors) keeps its cheap tests there."""


def covering_marks(*positions: int, mod: int = 3) -> tuple[pytest.MarkDecorator, ...]:
    """``()`` for a case ``make test`` runs, ``(pytest.mark.slow,)`` for one only ``test-slow`` runs."""
    return () if sum(positions) % mod == 0 else (pytest.mark.slow,)
