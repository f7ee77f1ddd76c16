"""Where a scanned stage's blocks live in a parameter tree, and the checkpoint paths they stand for.

A ``stacking.BlockStack`` keeps its N blocks' weights under one attribute, ``stacked``, with a
leading (N,) layer axis: the parameter ``X.stacked.Y`` holds the checkpoint's ``X.<i>.Y`` for every
block i (``X.<a>:<b>.stacked.Y`` for a run ``a..b`` of ``stacking.block_runs``). These names are
read by the code that walks parameters without running a stage (storage's upcast, the LoRA
targets), so they sit in this leaf module rather than beside the scan.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

__all__ = ["STACKED", "RUN", "block_path", "is_stacked_path"]

STACKED = "stacked"  # the attribute a BlockStack keeps its block under: path X.stacked.Y <-> X.<i>.Y
RUN = re.compile(r"^(\d+):(\d+)$")  # a run's key in ``block_runs``: X.<a>:<b>.stacked.Y <-> X.<a + i>.Y


def block_path(stack_path: Sequence[Any], i: int) -> tuple[str, ...]:
    """The checkpoint path of block ``i`` of the ``BlockStack`` at ``stack_path``: ``X.<i>``, or
    ``X.<a + i>`` for a run ``X.<a>:<b>`` of ``block_runs``."""
    names = tuple(str(p) for p in stack_path)
    run = RUN.match(names[-1]) if names else None
    if run:
        return (*names[:-1], str(int(run.group(1)) + i))
    return (*names, str(i))


def is_stacked_path(path: tuple[Any, ...]) -> bool:
    """Whether a parameter path (State keys or ``jax.tree_util`` keys) lies inside a ``BlockStack``."""
    return any(getattr(p, "key", getattr(p, "name", p)) == STACKED for p in path)
