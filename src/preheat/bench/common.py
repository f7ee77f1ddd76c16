"""What every benchmark shares: repeated timing with warm-up, summaries, the machine line, and
random-weight stand-ins for published architectures (no hub access needed)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

__all__ = ["timed", "summary", "machine_line", "ARCHITECTURES", "write_pixel_architecture", "fmt_summary", "write_json",
           "Condition", "Timed", "time_interleaved", "condition_rows", "conditions_table", "load_average"]

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


def ratio(rows: list[dict[str, Any]], a: str, b: str, of: str = "images_per_s") -> float:
    """Condition ``a``'s ``of`` over condition ``b``'s (:func:`condition_rows`; "denoise_s": the medians)."""
    by = {r["condition"]: r for r in rows}
    mine, theirs = by[a][of], by[b][of]
    return (mine["median"] / theirs["median"]) if isinstance(mine, dict) else mine / theirs


def load_average() -> tuple[float, float, float] | None:
    """``os.getloadavg()``, or None where the platform has none: other jobs skew every timing."""
    try:
        return os.getloadavg()
    except OSError:
        return None
