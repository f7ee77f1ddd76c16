"""Helpers the experiments share that the package's own benchmarks do not (moved out of
``preheat.bench.common``): round-robin timing of compiled calls, a jaxpr walk, and the in-process
"conditions" benchmarks' call and header."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterator, Mapping

from preheat.bench.common import load_average, machine_line

__all__ = ["round_robin_ms", "equations", "plain_call", "condition_header", "header_line"]


def round_robin_ms(calls: Mapping[str, Callable[[], Any]], rounds: int, per_call: int = 1) -> dict[str, float]:
    """Median milliseconds of each of ``calls`` (each returns JAX arrays, waited for), over
    ``rounds`` rounds that time every call once, in turn: drifting load on a shared machine then
    moves all of them alike, so their ratios hold. A first call of each, untimed, pays its
    first-execution work. ``per_call``: a call runs that many layers, and the times are per layer."""
    import jax

    for fn in calls.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append((time.perf_counter() - start) * 1e3 / per_call)
    return {name: statistics.median(t) for name, t in times.items()}


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of the jaxprs its equations hold (scan, cond and pjit bodies,
    custom rules), depth first: what a count of a program's primitives must walk."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def plain_call(pipe: Any, steps: int, size: tuple[int, int] | None) -> tuple[dict[str, Any], tuple[int, int]]:
    """A conditions bench's common call: ``steps``, seed 0, the required inputs at their examples, at
    ``size`` (the model's own when None) -- its ``generate`` keywords and its (width, height)."""
    from preheat.families.inputs import IMAGE_SIZE, example_inputs

    width, height = size if size is not None else pipe.family.native_size(pipe)
    inputs = {"steps": steps, "seed": 0, **example_inputs(pipe.family.input_specs(pipe)),
              **IMAGE_SIZE.inputs((width, height))}
    return inputs, (width, height)


def condition_header(model: str | None, pipe: Any, sig: Any, n: int, steps: int, dtype: str, repeats: int,
                     size: tuple[int, int]) -> dict[str, Any]:
    """What an in-process conditions bench ran (the model, its call, the machine and its load): the
    fields :func:`header_line` reads, its result's first ones."""
    return {"model": model or "built-in:digits", "family": pipe.family.name, "machine": machine_line(),
            "load_average": load_average(), "n": n, "steps": steps, "dtype": dtype, "repeats": repeats,
            "sampler": pipe.defaults["sampler"], "guided": bool(sig.guided), "size": list(size),
            "sample_shape": list(sig.sample_shape)}


def header_line(result: Mapping[str, Any], beside: str) -> str:
    """A conditions bench's first markdown line: the model and what runs ``beside`` it, the call, the machine."""
    load = result["load_average"]
    return (f"**{result['model']}** ({result['family']}) + {beside}, batch {result['n']}, {result['steps']} steps "
            f"{result['sampler']}{' +cfg' if result['guided'] else ''}, {result['size'][0]}x{result['size'][1]} "
            f"(latents {result['sample_shape']}), {result['dtype']}, {result['repeats']} rounds — {result['machine']}"
            + (f"; load average {load[0]:.1f}" if load else ""))
