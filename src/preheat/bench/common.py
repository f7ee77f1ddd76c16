"""What every benchmark shares: repeated timing with warm-up, summaries, the machine line, and
random-weight stand-ins for published architectures (no hub access needed)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple

__all__ = ["timed", "round_robin_ms", "summary", "machine_line", "ARCHITECTURES", "write_pixel_architecture", "fmt_summary", "write_json",
           "equations", "Condition", "Timed", "time_interleaved", "condition_rows", "conditions_table", "load_average"]

# Published architectures, for random-weight benchmark models (config.json of the checkpoint).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "ddpm-cifar10-32": dict(  # google/ddpm-cifar10-32: 35.7 M parameters, 12.1 GFLOP / image / step
        sample_size=32, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=[128, 256, 256, 256],
        down_block_types=["DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
        attention_head_dim=None, norm_eps=1e-6, norm_num_groups=32, act_fn="silu",
        flip_sin_to_cos=False, freq_shift=1, downsample_padding=0, center_input_sample=False,
        mid_block_scale_factor=1, time_embedding_type="positional",
    ),
}
_DDPM_SCHEDULER = {"_class_name": "DDPMScheduler", "num_train_timesteps": 1000, "beta_schedule": "linear",
                   "beta_start": 0.0001, "beta_end": 0.02, "clip_sample": True, "variance_type": "fixed_large"}


def write_pixel_architecture(name: str, out: Path) -> Path:
    """A random-weight pixel pipeline folder of a published architecture (``ARCHITECTURES``), built
    with JAX and saved in diffusers format."""
    from flax import nnx

    from preheat.files import atomic_write_bytes
    from preheat.models.loading import save_unet
    from preheat.models.unet2d import UNet2DConfig, UNet2DModule

    config = UNet2DConfig.from_dict(ARCHITECTURES[name])
    model = UNet2DModule(config, rngs=nnx.Rngs(0))
    save_unet(config, nnx.state(model), out / "unet")
    atomic_write_bytes(out / "scheduler" / "scheduler_config.json", json.dumps(_DDPM_SCHEDULER).encode())
    atomic_write_bytes(out / "model_index.json", json.dumps({"_class_name": "DDPMPipeline", "preheat": {
        "defaults": {"sampler": "ddim", "steps": 20}}}).encode())
    return out


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


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


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt_summary(s: dict[str, float], scale: float = 1.0, digits: int = 3) -> str:
    return f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f})"


def machine_line() -> str:
    """One line: CPU, cores, memory, accelerator, versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = float("nan")
    import jax

    from preheat.platforms import accelerator_label, describe_device

    return (f"{cpu}, {os.cpu_count()} cores, {mem_gb:.0f} GiB RAM, {accelerator_label()}; "
            f"python {platform.python_version()}, jax {jax.__version__} ({describe_device()['platform']})")


def write_json(path: Path | None, data: Any) -> None:
    if path is None:
        return
    from preheat.files import atomic_write_bytes

    atomic_write_bytes(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


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


class Condition(NamedTuple):
    """One condition of an in-process bench: the pipeline and its ``generate(n, **inputs)`` keywords."""

    pipe: Any
    inputs: dict[str, Any]


class Timed(NamedTuple):
    """A condition's times (:func:`time_interleaved`)."""

    first_call_s: float  # the first call: its compile (and any file read) included
    call_s: list[float]  # whole ``generate`` calls: encode, denoise, decode
    denoise_s: list[float]  # the denoising program alone
    sig: Any  # the denoising program's signature


def time_interleaved(conditions: Mapping[str, Condition], n: int, repeats: int) -> dict[str, Timed]:
    """Each condition called once untimed-but-for-its-first-call (compiling it), then ``repeats``
    rounds, each timing every condition once, so that a shared machine's load falls on all alike."""
    import jax

    first: dict[str, float] = {}
    programs: dict[str, tuple[Any, Any, Any]] = {}
    for name, (pipe, inputs) in conditions.items():
        t0 = time.perf_counter()
        pipe.generate(n, **inputs)
        first[name] = time.perf_counter() - t0
        sig, args = pipe.prepare(n, **inputs)
        programs[name] = (pipe.executable(sig, args), args, sig)
    calls: dict[str, list[float]] = {name: [] for name in conditions}
    loops: dict[str, list[float]] = {name: [] for name in conditions}
    for _ in range(repeats):
        for name, (pipe, inputs) in conditions.items():
            t0 = time.perf_counter()
            pipe.generate(n, **inputs)
            calls[name].append(time.perf_counter() - t0)
            program, args, _ = programs[name]
            t0 = time.perf_counter()
            jax.block_until_ready(program(args))
            loops[name].append(time.perf_counter() - t0)
    return {name: Timed(first[name], calls[name], loops[name], programs[name][2]) for name in conditions}


def condition_rows(timed: Mapping[str, Timed], n: int) -> list[dict[str, Any]]:
    """One report row per condition of :func:`time_interleaved` (``n`` images a call)."""
    return [{"condition": name, "first_call_s": t.first_call_s, "call_s": summary(t.call_s),
             "denoise_s": summary(t.denoise_s), "images_per_s": n / summary(t.call_s)["median"]}
            for name, t in timed.items()]


def conditions_table(rows: list[dict[str, Any]],
                     extra: Mapping[str, Callable[[dict[str, Any]], str]] | None = None) -> list[str]:
    """:func:`condition_rows` as markdown lines; ``extra``: column header -> its cell, after the condition."""
    extra = extra or {}
    head = ["condition", *extra, "call s, median (min–max)", "denoise s, median (min–max)", "images/s", "first call s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["condition"], *(cell(r) for cell in extra.values()), fmt_summary(r["call_s"]),
                 fmt_summary(r["denoise_s"]), f"{r['images_per_s']:.2f}", f"{r['first_call_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plain_call(pipe: Any, steps: int, size: tuple[int, int] | None) -> tuple[dict[str, Any], tuple[int, int]]:
    """A conditions bench's common call: ``steps``, seed 0, the required inputs at their examples, at
    ``size`` (the model's own when None) -- its ``generate`` keywords and its (width, height)."""
    from preheat.families.inputs import IMAGE_SIZE, example_inputs

    width, height = size if size is not None else pipe.family.native_size(pipe)
    inputs = {"steps": steps, "seed": 0, **example_inputs(pipe.family.input_specs(pipe)),
              **IMAGE_SIZE.inputs((width, height))}
    return inputs, (width, height)


def ratio(rows: list[dict[str, Any]], a: str, b: str, of: str = "images_per_s") -> float:
    """Condition ``a``'s ``of`` over condition ``b``'s (:func:`condition_rows`; "denoise_s": the medians)."""
    by = {r["condition"]: r for r in rows}
    mine, theirs = by[a][of], by[b][of]
    return (mine["median"] / theirs["median"]) if isinstance(mine, dict) else mine / theirs


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


def load_average() -> tuple[float, float, float] | None:
    """``os.getloadavg()``, or None where the platform has none: other jobs skew every timing."""
    try:
        return os.getloadavg()
    except OSError:
        return None
