"""Autotune-and-replace: an entry compiled without the GPU (``preheat warm --target``) gets a
second, autotuned compile on the GPU, and keeps whichever executable is faster.

A deviceless compile cannot time kernels, so XLA picks its GPU kernels (GEMM tilings, cuDNN
algorithms, fusion splits) by heuristics; such an entry's manifest says ``"autotuned": false``.
A pod serves from it at once: nothing here is on the path of a first request. Under ``preheat
warm`` on the pod (``JaxCompiler.retune``), each not-autotuned entry it hits is compiled again
on the local GPU, where XLA autotunes, and both executables are timed on the call's own
arguments. The new one replaces the entry (``preheat.cache.entries.replace_entry``: atomic)
only if it is faster by more than ``MARGIN``; either way the manifest records both timings
(``retune``), so an entry is retuned once, and ``preheat cache ls`` shows the outcome.

    needs_retune(manifest)      not autotuned, and never retuned
    autotunes_here()            the local backend autotunes (a GPU, autotuning not switched off)
    decide(old_s, new_s)        the pure rule: replace only when clearly faster
    retune_entry(...)           time both, decide, replace or annotate; returns the one to serve

The fleet store keeps the entry that was pushed: a pod's timing is its own, and entries in the
store are immutable per key; every pod retunes under its own ``preheat warm``.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from preheat.cache.entries import MANIFEST, SCHEMA, replace_entry, rewrite_manifest

__all__ = ["MARGIN", "Retune", "needs_retune", "autotunes_here", "decide", "time_call", "retune_entry"]

# A new executable must be this much faster to replace the old: two compiles of one program time
# within a percent or two of each other, and swapping on noise would churn the cache for nothing.
MARGIN = 0.02
TIMED_CALLS = 5
_CORE = ("schema", "kind", "key", "fields", "files", "created")  # manifest fields replace_entry writes
# A pulled entry's manifest keeps the fleet store's signature (``preheat.cache.signing``), which
# covers the manifest as it was: a changed one must not carry it (a push signs afresh).
_STALE = ("signature",)


class Retune(NamedTuple):
    """What one retune measured and decided (recorded in the manifest as ``retune``)."""

    deviceless_s: float  # median seconds of a call of the entry's (not autotuned) executable
    autotuned_s: float  # the same for the executable compiled on this GPU, autotuned
    replaced: bool  # the autotuned executable now serves the key
    at: float  # when (epoch seconds)


def needs_retune(manifest: dict[str, Any]) -> bool:
    """A GPU entry compiled without autotuning that no retune has looked at yet (a CPU entry
    says ``autotuned: false`` too: XLA:CPU has nothing to autotune)."""
    fields = manifest.get("fields")
    return (isinstance(fields, dict) and fields.get("platform") == "gpu" and manifest.get("autotuned") is False
            and "retune" not in manifest)


def autotunes_here() -> bool:
    """Whether a compile in this process autotunes: XLA autotunes on GPUs only, unless
    ``--xla_gpu_autotune_level=0`` switches it off."""
    import jax

    flags = os.environ.get("XLA_FLAGS", "").split()
    return jax.devices()[0].platform == "gpu" and "--xla_gpu_autotune_level=0" not in flags


def decide(old_s: float, new_s: float, margin: float = MARGIN) -> bool:
    """Replace only when the new executable is faster by more than ``margin`` (a fraction)."""
    if not (old_s > 0 and new_s > 0):
        return False  # a timing that is no timing never replaces anything
    return new_s < old_s * (1.0 - margin)


def time_call(executable: Callable[[Any], Any], args: Any, repeats: int = TIMED_CALLS) -> float:
    """Median seconds of ``executable(args)`` to its results on the device, after one untimed call
    (first-call work: buffers, kernels' modules)."""
    import jax

    jax.block_until_ready(executable(args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(executable(args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def retune_entry(path: Path, served: Any, autotuned: Any, files: dict[str, bytes], args: Any,
                 timer: Callable[[Any, Any], float] = time_call) -> tuple[Any, Retune]:
    """Time ``served`` (loaded from the entry at ``path``) and ``autotuned`` (``files``: its
    entry's payload, serialized) on ``args``; replace the entry when ``decide`` says so, else record the
    timings in its manifest. Returns the executable to serve from now on, and the record.
    ``timer(executable, args)``: seconds per call (tests inject it; ``time_call`` measures)."""
    manifest = _read_manifest(path)
    old_s, new_s = timer(served, args), timer(autotuned, args)
    result = Retune(deviceless_s=old_s, autotuned_s=new_s, replaced=decide(old_s, new_s), at=time.time())
    record = result._asdict()
    if result.replaced:
        extra = {k: v for k, v in manifest.items() if k not in _CORE + _STALE}
        extra.update(autotuned=True, retune=record)
        replace_entry(path.parent, path.name, files, manifest["fields"], extra=extra)
        return autotuned, result
    kept = {k: v for k, v in manifest.items() if k not in _STALE}
    rewrite_manifest(path, {**kept, "retune": record})  # the executable stays; retuned once
    return served, result


def _read_manifest(path: Path) -> dict[str, Any]:
    import json

    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("schema") != SCHEMA or manifest.get("key") != path.name:
        raise ValueError(f"entry {path.name}: a manifest of another schema or key")
    return manifest
