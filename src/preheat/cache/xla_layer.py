"""The xla layer: JAX's persistent compilation cache, as preheat uses it (``<root>/compile/xla``).

It is a module of its own because JAX's cache is process state, not a compiler's: JAX has one cache
directory per process (``jax_compilation_cache_dir``), read once when its cache opens, and one
switch for it. So everything here is module-level and shared by every ``JaxCompiler`` of the process:

- ``configure_persistent_cache``: once per process, the thresholds that keep small programs too,
  the hit counter (``hit_count``), and the first root's directory.
- ``persistent_cache_at(root)``: roots take turns. A compile for the root JAX points at joins the
  compiles in flight; one for another root waits until none is in flight, re-points JAX
  (``reset_cache``), and runs; newcomers for the old root wait behind it. Each load reads and
  writes its own root's ``compile/xla``, never another's.
- ``persistent_cache_disabled()`` / ``compile_uncached``: a compile that neither reads nor writes
  JAX's cache. ``cache="off"`` needs it (once a full or xla load set the directory, a plain compile
  would use that load's root), and so does full mode's compile on an aot miss: an executable that
  XLA:CPU loaded from JAX's persistent cache serialises into an entry that fails at run time,
  "NOT_FOUND: Function multiply_exponential_fusion not found (type id: 1)" on the built-in model's
  sampling program (and "... concatenate_bitcast_fusion ..." on a plain fori_loop + conv), seen on
  jax 0.10.2 and re-checked on 0.11.2 (docs/cache.md). So full mode, whose aot layer serves every
  later start, compiles its programs (the sampling program among them) with JAX's cache off and
  serialises that, unless the platform is in ``compile.XLA_SERIALISE_SAFE_PLATFORMS`` (CUDA, since the GPU
  check's row 8 showed it safe on an H200); JAX's cache is the whole story in "xla" mode.

The compilers that use it are in ``preheat.cache.compile``.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any, Iterator

import jax

__all__ = ["configure_persistent_cache", "persistent_cache_at", "persistent_cache_disabled", "compile_uncached",
           "hit_count"]

_persistent_configured = False
_xla_hits = threading.local()


def _on_event(event: str, **kwargs: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _xla_hits.count = getattr(_xla_hits, "count", 0) + 1


def hit_count() -> int:
    """How many compiles on this thread JAX's persistent cache has served (a compile was an xla
    hit when the count grew across it)."""
    return getattr(_xla_hits, "count", 0)


def configure_persistent_cache(root: Path) -> None:
    """Set JAX's persistent compilation cache up for preheat (once per process): thresholds that
    keep small programs too, the hit counter, and -- for the first root -- its directory,
    ``<root>/compile/xla``. A later root is pointed at when a program of its load compiles
    (``persistent_cache_at``), never here: another load may be compiling into the first."""
    global _persistent_configured
    if _persistent_configured:
        return
    with _dir_turns:  # two loads starting in threads: one registers the hit counter (a second would count twice)
        if _persistent_configured:
            return
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        try:
            jax.monitoring.register_event_listener(_on_event)
        except Exception:  # pragma: no cover - older jax
            pass
        if _dir_current is None:
            _point_at(root / "compile" / "xla")
        _persistent_configured = True


def _point_at(xla_dir: Path) -> None:
    """Point JAX's persistent cache at ``xla_dir`` (held: ``_dir_turns``, no compile through the old one
    in flight). JAX reads the directory once, when it first opens its cache (a compile before this
    one: jax #25768), so ``reset_cache`` makes the next compile open it again."""
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    global _dir_current
    xla_dir.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(xla_dir))
    reset_cache()
    _dir_current = xla_dir


@contextlib.contextmanager
def persistent_cache_at(root: Path) -> Iterator[None]:
    """Compile with JAX's persistent cache on ``<root>/compile/xla``: the xla layer of the load
    that is compiling, whichever root the process used before.

    JAX has one cache directory per process, read when its cache opens, so a compile cannot choose
    its own. Compiles for the root already pointed at run concurrently and cost a lock and a count
    (a one-root process never re-points); a compile for another root waits until none is in flight,
    re-points (``_point_at``), and runs. While it waits, newcomers for the current root wait too
    (it cannot starve). So two pipelines on different roots compiling in threads take turns, and
    each program is read from and written to its own load's root, never the other's. JAX's other
    compiles in the process (eager operations, weight conversions) use whichever root was pointed
    at last: an entry in JAX's cache is keyed on the whole program, so that decides only where it
    lands, never what a program gets.
    """
    global _dir_users
    xla_dir = root / "compile" / "xla"
    if getattr(_dir_held, "dir", None) == xla_dir:  # re-entered on this thread: it already has its turn
        yield
        return

    def my_turn() -> bool:
        if _dir_current == xla_dir:  # joins the compiles in flight, unless another root is waiting
            return not any(n for d, n in _dir_waiting.items() if d != xla_dir)
        return _dir_users == 0  # none in flight: re-point

    with _dir_turns:
        if not my_turn():
            _dir_waiting[xla_dir] = _dir_waiting.get(xla_dir, 0) + 1
            try:
                _dir_turns.wait_for(my_turn)
            finally:
                _dir_waiting[xla_dir] -= 1
                if not _dir_waiting[xla_dir]:
                    del _dir_waiting[xla_dir]
        if _dir_current != xla_dir:
            _point_at(xla_dir)
        _dir_users += 1
        _dir_turns.notify_all()  # the waiters for this root may join now
    _dir_held.dir = xla_dir
    try:
        yield
    finally:
        _dir_held.dir = None
        with _dir_turns:
            _dir_users -= 1
            _dir_turns.notify_all()


_dir_turns = threading.Condition()
_dir_current: Path | None = None  # the compile/xla JAX's persistent cache is pointed at
_dir_users = 0  # compiles through it in flight (persistent_cache_at)
_dir_waiting: dict[Path, int] = {}  # compiles waiting for their turn, per directory
_dir_held = threading.local()  # .dir: the directory this thread's compile holds


@contextlib.contextmanager
def persistent_cache_disabled() -> Iterator[None]:
    """Compile without JAX's persistent cache (no read, no write) for the duration.

    JAX decides once per process whether the cache is used (``is_cache_used`` latches), so the
    config flag alone does nothing after the first compile: ``reset_cache`` (the public
    ``jax.experimental.compilation_cache`` API) makes it look again, before and after.

    Threads (a server's idle retune compiles beside its worker): the first to enter switches the
    cache off, the last to leave restores it, so overlapping uses never leave it off.
    """
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    global _disabled_by, _enabled_before
    with _disable_lock:
        if _disabled_by == 0:
            _enabled_before = jax.config.jax_enable_compilation_cache
            jax.config.update("jax_enable_compilation_cache", False)
            reset_cache()
        _disabled_by += 1
    try:
        yield
    finally:
        with _disable_lock:
            _disabled_by -= 1
            if _disabled_by == 0:
                jax.config.update("jax_enable_compilation_cache", _enabled_before)
                reset_cache()


def compile_uncached(lowered: Any) -> Any:
    """``lowered.compile()`` with JAX's persistent cache neither read nor written: ``cache="off"``.
    The cache's directory is process-wide once a full or xla load set it, so a plain compile after
    one would read and write that load's root."""
    with persistent_cache_disabled():
        return lowered.compile()


_disable_lock = threading.Lock()
_disabled_by = 0  # threads inside persistent_cache_disabled
_enabled_before = False
