"""What loading weights cost, measured: bytes, tensors, seconds and host memory (``LoadReport``),
per fill and summed over a whole pipeline load (``recording()``).

Host memory comes from the kernel's high-water mark (``/proc/self/status``), reset per window,
so short peaks are never missed and no sampler thread costs CPU. ``preheat.models.weights``
records a report for every fill; ``preheat.load`` wraps the whole load in ``recording()``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoadReport", "LoadRecording", "recording", "record", "PeakWindow"]


def _proc_status() -> tuple[int | None, int | None]:
    """(VmRSS, VmHWM) of this process in bytes; (None, None) where /proc is absent."""
    rss = hwm = None
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith(b"VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, hwm


_WINDOWS_LOCK = threading.Lock()
_WINDOWS: list["PeakWindow"] = []


class PeakWindow:
    """Peak resident set size between ``open`` and ``close``, from the kernel's high-water mark.

    Why VmHWM and not sampling: the kernel tracks the exact peak, and a sampler thread misses
    short peaks (and costs CPU). The mark is reset at the start (``/proc/self/clear_refs`` 5), so
    it covers this window only; every open window first absorbs the mark, so nested windows (a
    pipeline around its components) stay exact. Where the reset is not allowed, the mark is the
    process's lifetime peak, an upper bound (``exact`` False). Side effect: ``ru_maxrss`` then
    counts from the last reset.
    """

    def __init__(self) -> None:
        with _WINDOWS_LOCK:
            self.before, hwm = _proc_status()
            for w in _WINDOWS:
                w.peak = max(w.peak or 0, hwm or 0)
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                self.exact = self.before is not None
            except OSError:
                self.exact = False
            self.peak: int | None = self.before
            _WINDOWS.append(self)

    def close(self) -> tuple[int | None, int | None, int | None, bool]:
        """(rss before, peak rss, rss after, exact)."""
        with _WINDOWS_LOCK:
            after, hwm = _proc_status()
            if self in _WINDOWS:
                _WINDOWS.remove(self)
        peak = None if hwm is None else max(self.peak or 0, hwm)
        return self.before, peak, after, self.exact


@dataclass(frozen=True)
class LoadReport:
    """What loading weights cost: bytes, tensors, seconds, and host memory.

    Host memory is the resident set (VmRSS, VmHWM: see ``PeakWindow``). ``peak_host_bytes`` is
    the growth from the start of the load to its peak; ``transient_host_bytes`` is the peak minus
    the resident set after the load: what the load needed beyond what it keeps. On the CPU backend
    device arrays live in host memory too, so the growth includes the weights themselves and the
    transient is the figure to hold against ``largest_tensor_bytes`` / ``largest_file_bytes``.
    The transient can read low when the allocator keeps freed memory (it then stays in
    ``rss_after``); on the CPU backend ``peak_host_bytes - placed_bytes`` is the stricter figure.
    """

    source: str
    files: tuple[str, ...] = ()
    tensors: int = 0
    bytes_read: int = 0  # checkpoint bytes read from disk
    placed_bytes: int = 0  # bytes of the arrays put on the device (after casts)
    seconds: float = 0.0  # read + cast + place on the device, transfers finished
    largest_tensor_bytes: int = 0
    largest_file_bytes: int = 0
    rss_before: int | None = None
    peak_rss: int | None = None
    rss_after: int | None = None
    peak_exact: bool = False
    abstract_s: float = 0.0  # abstract model builds (nnx.eval_shape), pipeline totals only
    parts: tuple["LoadReport", ...] = ()

    @property
    def peak_host_bytes(self) -> int | None:
        return None if self.peak_rss is None or self.rss_before is None else self.peak_rss - self.rss_before

    @property
    def transient_host_bytes(self) -> int | None:
        return None if self.peak_rss is None or self.rss_after is None else self.peak_rss - self.rss_after

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in (
            "source", "tensors", "bytes_read", "placed_bytes", "seconds", "abstract_s", "largest_tensor_bytes",
            "largest_file_bytes", "rss_before", "peak_rss", "rss_after", "peak_exact")}
        out.update(files=list(self.files), peak_host_bytes=self.peak_host_bytes,
                   transient_host_bytes=self.transient_host_bytes)
        if self.parts:
            out["parts"] = [p.to_dict() for p in self.parts]
        return out


@dataclass(eq=False)  # told apart by identity: recordings nest
class LoadRecording:
    """The reports of every ``fill`` inside one ``recording()``; ``total`` is set when it ends."""

    reports: list[LoadReport] = field(default_factory=list)
    abstract_s: float = 0.0
    total: LoadReport | None = None


_RECORDINGS: list[LoadRecording] = []


@contextmanager
def recording(source: str = "all") -> Iterator[LoadRecording]:
    """Collect the ``LoadReport`` of every fill (and the abstract builds' time) while inside.

    ``total`` sums the parts, and its host-memory figures cover the whole block (config reads and
    abstract builds included), e.g. all of ``preheat.load``. Process-wide: a fill on any thread counts.
    """
    rec = LoadRecording()
    window = PeakWindow()
    with _WINDOWS_LOCK:
        _RECORDINGS.append(rec)
    try:
        yield rec
    finally:
        with _WINDOWS_LOCK:
            _RECORDINGS.remove(rec)
        before, peak, after, exact = window.close()
        parts = tuple(rec.reports)
        rec.total = LoadReport(
            source=source, files=tuple(f for p in parts for f in p.files), tensors=sum(p.tensors for p in parts),
            bytes_read=sum(p.bytes_read for p in parts), placed_bytes=sum(p.placed_bytes for p in parts),
            seconds=sum(p.seconds for p in parts),
            largest_tensor_bytes=max((p.largest_tensor_bytes for p in parts), default=0),
            largest_file_bytes=max((p.largest_file_bytes for p in parts), default=0),
            rss_before=before, peak_rss=peak, rss_after=after, peak_exact=exact, abstract_s=rec.abstract_s,
            parts=parts)


def record(report: LoadReport | None = None, abstract_s: float = 0.0) -> None:
    """Add a fill's report (or an abstract build's time) to every open recording."""
    with _WINDOWS_LOCK:
        for rec in _RECORDINGS:
            if report is not None:
                rec.reports.append(report)
            rec.abstract_s += abstract_s
