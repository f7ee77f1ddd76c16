"""What every benchmark shares: repeated timing with warm-up, summaries, the machine line, and
random-weight stand-ins for published architectures (no hub access needed)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["timed", "summary", "machine_line", "materialize_model", "fmt_summary", "write_json"]

def materialize_model(name_or_path: str | None, workdir: Path) -> str | None:
    """A model argument for preheat.load: a path, None (built-in), or the folder of a random model
    (``random:NAME`` or an old bench name, see ``preheat.bench.random_models``) written once under
    ``workdir``."""
    from preheat.bench.random_models import build_random, random_name

    name = random_name(name_or_path)
    if name is None:
        return name_or_path
    return str(build_random(name, workdir / name))


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

    dev = jax.devices()[0]
    accel = "no accelerator" if dev.platform == "cpu" else f"{jax.device_count()}x {dev.device_kind}"
    return (f"{cpu}, {os.cpu_count()} cores, {mem_gb:.0f} GiB RAM, {accel}; "
            f"python {platform.python_version()}, jax {jax.__version__} ({dev.platform})")


def write_json(path: Path | None, data: Any) -> None:
    if path is None:
        return
    from preheat.files import atomic_write_bytes

    atomic_write_bytes(path, (json.dumps(data, indent=2, default=str) + "\n").encode())
