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
    retune_now(...)             ``preheat warm``'s whole retune of one hit: compile, time, decide
    record_failure(path, ...)   a failed retune, whichever path ran it: logged, and kept in the manifest
    IdleRetuner                 the same for a server, while it is idle (``preheat serve --retune-idle-s``)

A server (``preheat.server.core``) runs every device call on one worker thread, so there the work
is split: the autotuned compile runs on a thread of its own (XLA compiles release the GIL), and
each timed call is one job the worker takes only when no request waits, so a request never waits
behind more than one timed call. The winner is swapped into the pipeline's executables by that
worker, between requests.

The fleet store keeps the entry that was pushed: a pod's timing is its own, and entries in the
store are immutable per key; every pod retunes under its own ``preheat warm``.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from preheat import platforms
from preheat.cache.entries import MANIFEST, SCHEMA, replace_entry, rewrite_manifest
from preheat.cache.executables import Executables

__all__ = ["MARGIN", "Retune", "Candidate", "IdleRetuner", "needs_retune", "autotunes_here", "decide", "time_call",
           "timed_call", "retune_entry", "retune_now", "record_failure", "failure_message"]

log = logging.getLogger("preheat.cache")

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
    """An entry of a platform whose compiles autotune (a GPU), compiled without autotuning, that no
    retune has looked at yet (a CPU entry says ``autotuned: false`` too: XLA:CPU has nothing to
    autotune)."""
    fields = manifest.get("fields")
    return (isinstance(fields, dict) and platforms.get(str(fields.get("platform"))).autotunes
            and manifest.get("autotuned") is False and "retune" not in manifest)


def autotunes_here() -> bool:
    """Whether a compile in this process autotunes (``preheat.platforms.autotunes_here``: XLA
    autotunes on GPUs only, unless ``--xla_gpu_autotune_level=0`` switches it off)."""
    return platforms.autotunes_here()


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


def timed_call(executable: Callable[[Any], Any], args: Any) -> float:
    """Seconds of one call of ``executable(args)`` to its results on the device (a server's
    timing job: one call at a time, so that a request waits behind one call at most)."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(executable(args))
    return time.perf_counter() - start


def failure_message(exc: BaseException) -> str:
    """A failed retune in one line: the exception's type and the first line of its text."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def record_failure(path: Path, exc: BaseException) -> str:
    """A retune of the entry at ``path`` failed (``preheat warm`` or a server's idle retune: both
    come here): say so in the log and in the entry's manifest, where ``preheat cache ls`` and
    ``cache explain`` show it. The executable stays, and the entry is not retried on every idle
    spell or start (``needs_retune`` is then False). Returns the one-line message. Never raises:
    an entry that went away meanwhile has nothing to record it in."""
    message = failure_message(exc)
    log.warning("preheat cache: retuning entry %s failed (%s); it serves as it is", path.name[:12], message)
    try:
        manifest = _read_manifest(path)
        kept = {k: v for k, v in manifest.items() if k not in _STALE}
        rewrite_manifest(path, {**kept, "retune": {"failed": message, "at": time.time()}})
    except (OSError, ValueError) as err:
        log.debug("cannot record the failed retune of %s: %s", path.name[:12], err)
    return message


def retune_now(path: Path, served: Any, program: Callable[[Any], Any], args: Any,
               compile: Callable[[Callable[[Any], Any], Any], tuple[Any, dict[str, bytes]]]) -> tuple[Any, Any]:
    """``preheat warm``'s retune of one not-autotuned entry it hit (``JaxCompiler.retune``): the
    autotuned compile (``compile(program, args) -> (executable, files)``), both timed
    (``retune_entry``), the entry replaced or annotated. Returns the executable to serve and what
    ``preheat warm`` reports of it: the ``Retune`` record with ``compile_s``, or "skipped: ..." /
    "failed: ..." (a failure is recorded in the manifest too: ``record_failure``)."""
    if not autotunes_here():
        return served, f"skipped: {platforms.local().name} compiles do not autotune"
    start = time.perf_counter()
    try:
        autotuned, files = compile(program, args)
        compile_s = time.perf_counter() - start
        chosen, result = retune_entry(path, served, autotuned, files, args)
    except Exception as exc:  # noqa: BLE001 - a retune is an optimisation: the entry keeps serving as it is
        return served, f"failed: {record_failure(path, exc)}"
    return chosen, {**result._asdict(), "compile_s": compile_s}


def _read_manifest(path: Path) -> dict[str, Any]:
    import json

    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("schema") != SCHEMA or manifest.get("key") != path.name:
        raise ValueError(f"entry {path.name}: a manifest of another schema or key")
    return manifest


class Candidate(NamedTuple):
    """An executable a server serves from a not-autotuned entry (``JaxCompiler.retune_later``
    collects one per such aot hit): what the idle retune compiles again, times and may swap."""

    key: str
    path: Path  # the entry
    sig: Any  # the engine's signature: the executable's in ``Pipeline.executables``
    program: Callable[[Any], Any]  # what was compiled (one argument)
    args: Any  # the call's own arguments (the warm-up's): what both executables are timed on
    served: Any  # the executable loaded from the entry


class _Work:
    """One candidate being retuned: compiling (its own thread), then its timed calls, then the decision."""

    def __init__(self, candidate: Candidate) -> None:
        self.candidate = candidate
        self.ready = False  # compiled: the worker may take the next timed call
        self.autotuned: Any = None
        self.files: dict[str, bytes] = {}
        self.compile_s = 0.0
        self.calls: list[tuple[Any, Optional[str]]] = []  # (executable, "old"|"new"|None: untimed first call)
        self.times: dict[str, list[float]] = {"old": [], "new": []}
        self.thread: Optional[threading.Thread] = None


class IdleRetuner:
    """A server's retune of its not-autotuned entries, while it is idle.

    The server's worker thread calls :meth:`next_task` under ``lock`` whenever it finds no request
    waiting. After ``idle_s`` seconds without a request, the next candidate's autotuned compile
    starts on a thread of its own (``compile(program, args) -> (executable, files)``:
    ``JaxCompiler.compile_autotuned``); once it is done, each call returned is ONE timed call
    (``timer(executable, args) -> seconds``, tests inject it; first an untimed call of each, then
    ``repeats`` of each, alternating), and the last one decides (``retune_entry``: the entry
    replaced atomically, or its timings recorded) and swaps the winner into ``executables`` (the
    pipeline's, by signature) if it still holds the served one. A failure anywhere is recorded
    in the manifest (``record_failure``) and the old executable keeps serving; :meth:`cancel`
    (drain, shutdown) drops whatever is pending, and writes nothing."""

    def __init__(self, idle_s: float, lock: threading.Condition, timer: Callable[[Any, Any], float] = timed_call,
                 repeats: int = TIMED_CALLS) -> None:
        self.idle_s = idle_s
        self.timer = timer
        self.repeats = repeats
        self._cond = lock
        # the compiler's list: appended on the worker thread (aot hits), taken from the front here
        # (taken ones are dropped: the old executable and its arguments are not held after)
        self._candidates: list[Candidate] = []
        self._seen: set[str] = set()  # keys taken (two signatures may share an entry: retuned once)
        self._executables: Optional[Executables] = None
        self._compile: Optional[Callable[[Callable[[Any], Any], Any], tuple[Any, dict[str, bytes]]]] = None
        self._work: Optional[_Work] = None
        self._canceled = False
        self.stats = {"replaced": 0, "kept": 0, "failed": 0, "canceled": 0}
        self.on_outcome: Callable[[str], None] = lambda outcome: None  # metrics

    def attach(self, pipe: Any) -> bool:
        """Before a server's warm-up: have ``pipe``'s compile cache collect the executables it
        serves from not-autotuned entries (``JaxCompiler.retune_later``), and retune those here.
        False, and nothing changed, where there is nothing to retune: a backend whose compile cache
        keeps no executables (torch), or a backend whose compiles do not autotune (the CPU)."""
        compiler = getattr(pipe, "compiler", None)
        executables = getattr(pipe, "executables", None)
        if compiler is None or not hasattr(compiler, "retune_later") or executables is None:
            log.debug("idle retune: off (this backend's compile cache has no executables to retune)")
            return False
        if not autotunes_here():
            log.debug("idle retune: off (%s compiles do not autotune)", platforms.local().name)
            return False
        compiler.retune_later = True
        self.bind(compiler.retune_candidates, executables, compiler.compile_autotuned)
        return True

    def bind(self, candidates: list[Candidate], executables: Executables,
             compile: Callable[[Callable[[Any], Any], Any], tuple[Any, dict[str, bytes]]]) -> None:
        """Retune ``candidates`` (a live list: later aot hits join it) served from ``executables``."""
        self._candidates, self._executables, self._compile = candidates, executables, compile

    @property
    def waiting(self) -> int:
        """Candidates not yet retuned (the one in progress included)."""
        return len({c.key for c in self._candidates} - self._seen) + (self._work is not None)

    @property
    def compiled(self) -> bool:
        """The retune in progress has its autotuned executable: its timed calls are next."""
        work = self._work
        return work is not None and work.ready

    @property
    def busy(self) -> bool:
        """A retune is in progress (compiling, or between its timed calls)."""
        return self._work is not None

    # ------------------------------------------------------------------ the worker's side (under lock)

    def next_task(self, idle_for: float) -> Optional[Callable[[], None]]:
        """Called with the lock held and no request waiting: a job for the worker (one timed call,
        or the decision), or None. Starts the next compile once ``idle_for >= idle_s``."""
        if self._canceled or self._compile is None:
            return None
        work = self._work
        if work is None:
            self._skip_seen()
            if not self._candidates or idle_for < self.idle_s:
                return None
            candidate = self._candidates.pop(0)
            self._seen.add(candidate.key)
            work = self._work = _Work(candidate)
            work.thread = threading.Thread(target=self._compile_on_thread, args=(work,),
                                           name="preheat-retune-compile", daemon=True)
            work.thread.start()
            return None
        if not work.ready:
            return None
        return functools.partial(self._step, work)

    def wait_s(self, idle_for: float) -> Optional[float]:
        """How long the worker may sleep before :meth:`next_task` has something to start (None:
        until notified, e.g. by the compile finishing)."""
        if self._canceled or self._compile is None or self._work is not None:
            return None
        self._skip_seen()
        if not self._candidates:
            return None
        return max(0.0, self.idle_s - idle_for)

    def _skip_seen(self) -> None:
        while self._candidates and self._candidates[0].key in self._seen:
            self._candidates.pop(0)

    def cancel(self) -> None:
        """Drop what is pending (the lock held or not): a compile in flight finishes on its thread
        and is thrown away; nothing is written."""
        with self._cond:
            if self._canceled:
                return
            self._canceled = True
            work, self._work = self._work, None
            if work is not None:
                self.stats["canceled"] += 1
        if work is not None:
            log.info("preheat cache: retune of entry %s canceled (shutting down)", work.candidate.key[:12])
            self.on_outcome("canceled")

    # ------------------------------------------------------------------ off the worker

    def _compile_on_thread(self, work: _Work) -> None:
        c = work.candidate
        start = time.perf_counter()
        try:
            try:
                current = _read_manifest(c.path)
            except OSError:  # quarantined or pruned since it was loaded: nothing to retune
                self._drop(work, f"entry {c.key[:12]} is gone; not retuned")
                return
            if not needs_retune(current):  # another process on this root retuned it first
                self._drop(work, f"entry {c.key[:12]} was retuned elsewhere meanwhile; left as it is")
                return
            work.autotuned, work.files = self._compile(c.program, c.args)
        except Exception as exc:  # noqa: BLE001 - a retune is an optimisation: never a crash
            self._fail(work, exc)
            return
        work.compile_s = time.perf_counter() - start
        work.calls = [(c.served, None), (work.autotuned, None)] + [
            call for _ in range(self.repeats) for call in ((c.served, "old"), (work.autotuned, "new"))]
        with self._cond:
            if self._work is work:
                work.ready = True
                self._cond.notify_all()

    # ------------------------------------------------------------------ on the worker, between requests

    def _step(self, work: _Work) -> None:
        """One timed call, or (none left) the decision. Never raises."""
        try:
            if work.calls:
                executable, role = work.calls.pop(0)
                seconds = self.timer(executable, work.candidate.args)
                if role is not None:
                    work.times[role].append(seconds)
                return
            self._decide(work)
        except Exception as exc:  # noqa: BLE001 - the old executable keeps serving
            self._fail(work, exc)

    def _decide(self, work: _Work) -> None:
        c = work.candidate
        with self._cond:
            if self._work is not work:  # canceled meanwhile
                return
        if not needs_retune(_read_manifest(c.path)):  # another process on this root retuned it first
            self._drop(work, f"entry {c.key[:12]} was retuned elsewhere meanwhile; left as it is")
            return
        old_s, new_s = statistics.median(work.times["old"]), statistics.median(work.times["new"])
        chosen, result = retune_entry(c.path, c.served, work.autotuned, work.files, c.args,
                                      timer=lambda executable, args: old_s if executable is c.served else new_s)
        swapped = False
        if result.replaced:
            with self._cond:
                held = self._executables
                swapped = held is not None and held.replace(c.sig, c.served, chosen)
        verb = "replaced by the autotuned compile" if result.replaced else "kept (the autotuned compile is not faster)"
        self._done(work, "replaced" if result.replaced else "kept",
                   f"entry {c.key[:12]} {verb}: {1e3 * old_s:.3g} -> {1e3 * new_s:.3g} ms a call "
                   f"(compiled in {work.compile_s:.1f}s{'' if swapped or not result.replaced else '; not served here'})")

    def _done(self, work: _Work, outcome: str, line: str) -> None:
        with self._cond:
            if self._work is not work:
                return
            self._work = None
            self.stats[outcome] += 1
            self._cond.notify_all()
        log.info("preheat cache: idle retune: %s", line)
        self.on_outcome(outcome)

    def _drop(self, work: _Work, line: str) -> None:
        """End ``work`` with no outcome of its own (the entry changed under it)."""
        with self._cond:
            if self._work is not work:
                return
            self._work = None
            self._cond.notify_all()
        log.info("preheat cache: idle retune: %s", line)

    def _fail(self, work: _Work, exc: BaseException) -> None:
        with self._cond:
            if self._work is not work:  # canceled: nothing to record
                return
        message = record_failure(work.candidate.path, exc)
        self._done(work, "failed", f"entry {work.candidate.key[:12]} failed ({message})")
