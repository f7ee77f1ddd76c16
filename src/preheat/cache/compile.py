"""The JAX compile cache, in layers: serialized executables (``aot``), then JAX's persistent
compilation cache (``xla``), then a fresh compile (``none``).

The ``aot`` layer skips tracing, lowering and compiling: the program of a call signature is
serialized with ``jax.experimental.serialize_executable`` and loaded on the next start, under the
program's key (``preheat.cache.keys``: everything that changes the program and nothing else;
weights are arguments, so every fine-tune of one architecture shares one entry). The ``xla``
layer is JAX's own process-wide cache (``preheat.cache.xla_layer``). Here: the compilers that
choose between them (``JaxCompiler``, ``TargetCompiler`` for another machine's GPU) and the
background loads (``Prefetch``), of programs the engine described (``Pipeline.describe``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import jax

from preheat import platforms
from preheat._version import __version__
from preheat.cache import xla_layer
from preheat.cache.entries import UNRUNNABLE, LoadingMarker, checked_entry, unrunnable, unrunnable_cudnn_calls
from preheat.cache.entry_cache import EntryCache
from preheat.cache.keys import key_fields, key_of, mesh_of
from preheat.errors import CacheEntryError, TargetError
from preheat.timings import Timings

__all__ = ["JaxCompiler", "TargetCompiler", "Prefetch", "on_device"]

log = logging.getLogger("preheat.cache")

EXECUTABLE = "executable.bin"

Items = list[tuple[dict[str, Any], Any, Any, int]]  # (fingerprint, signature, arguments, outputs) per program
# A prefetch item may carry a fifth element, the program itself (``Pipeline.program``): a miss is
# then compiled on the prefetch's own threads, every stage's at once (XLA compiles release the GIL).
BACKGROUND_COMPILES = 3  # at most this many at once: a cold start's encode, denoise and decode
BACKGROUND_COMPILES_ENV = "PREHEAT_BACKGROUND_COMPILES"  # 0: misses compile on the first call, in turn


def background_compiles() -> int:
    """How many prefetched misses may compile at once on the prefetch's threads (0: none)."""
    from preheat.errors import InvalidArgumentError

    raw = os.environ.get(BACKGROUND_COMPILES_ENV, "").strip()
    if not raw:
        return BACKGROUND_COMPILES
    if not raw.isdigit():
        raise InvalidArgumentError(f"{BACKGROUND_COMPILES_ENV} must be a count (0: off), got {raw!r}")
    return int(raw)


# The platforms where an executable loaded from JAX's persistent cache was shown to survive
# serialisation into an entry and a first run in a new process, so full mode need not compile with
# that cache off (``JaxCompiler.get_or_compile``): "cuda", measured on an H200 by the GPU check's
# row 8 (``xlaser``, docs/gpu.md: the entry ran, pixels identical). XLA:CPU's bug is known
# (docs/cache.md); ROCm, TPU and anything nobody measured keep the guard.
XLA_SERIALISE_SAFE_PLATFORMS: frozenset[str] = frozenset({"cuda"})
# Diagnostic only: "off" lifts the guard for this process on every platform (row 8, the tests).
SERIALISE_GUARD_ENV = "PREHEAT_XLA_SERIALISE_GUARD"


def serialise_guard(fields: dict[str, Any]) -> bool:
    """Whether a full-mode miss of the program keyed by ``fields`` compiles with JAX's persistent
    cache off, so that the executable it serialises never came from that cache. Read at each
    decision (``$PREHEAT_XLA_SERIALISE_GUARD=off`` set in a running process takes effect at the
    next compile).

    Not in the key, on purpose: the guard changes how an entry's executable was obtained (compiled
    now, or loaded from JAX's cache of the same HLO with the same compile options), never what it
    computes; both are XLA's compile of one program for one device. An entry the bug spoiled fails
    its first run and is quarantined and recompiled (``Pipeline.execute_stage``), and a guard-off
    process reads the same entries as everyone else, which is what row 8 needs to test them."""
    if os.environ.get(SERIALISE_GUARD_ENV, "").strip().lower() == "off":
        return False
    return serialise_platform(fields) not in XLA_SERIALISE_SAFE_PLATFORMS


def serialise_platform(fields: dict[str, Any]) -> str:
    """The key's platform as the guard tells them apart (``preheat.platforms.key_runtime``: "cuda"
    for a GPU key with the CUDA plugin; ROCm's devices are "gpu" too)."""
    return platforms.key_runtime(fields)


def _single_device(args: Any) -> list[Any]:
    """The device a single-device program runs on: its arguments' committed one (a host stage's
    CPU beside the accelerator: ``preheat.load(encoders_on="host")``), else JAX's default."""
    for leaf in jax.tree.leaves(args):
        if isinstance(leaf, jax.Array) and leaf.committed and len(leaf.devices()) == 1:
            return list(leaf.devices())
        sharding = getattr(leaf, "sharding", None)  # a prefetch's placeholder, placed
        if isinstance(leaf, jax.ShapeDtypeStruct) and isinstance(sharding, jax.sharding.SingleDeviceSharding):
            return list(sharding.device_set)
    return jax.devices()[:1]


class JaxCompiler(EntryCache):
    """``get_or_compile``: the executable for a signature, from the aot layer when it can.

    ``mode``: "full" (aot + xla + compile), "xla" (JAX's persistent cache only), "off". A fleet
    store (``remote``: a RemoteStore, None, or "env" = $PREHEAT_CACHE_URL) shares the aot layer only.
    """

    def __init__(self, root: Path | None = None, mode: str = "full", remote: Any = "env"):
        super().__init__("jax", root, mode, remote)
        self._prefetch: Prefetch | None = None  # executables loading on a background thread (prefetch())
        self._early: Any = None  # preheat.cache.early.EarlyLoads: the last start's keys, deserialising
        self._startup_id: str | None = None
        # ``preheat warm`` on a GPU sets this: an entry compiled without autotuning that it hits is
        # compiled again here, autotuned, and replaced if faster (``preheat.cache.retune``)
        self.retune = False
        # ``preheat serve`` on a GPU sets this instead: such hits are served as they are and
        # collected, for the server to retune while idle (``retune.IdleRetuner``)
        self.retune_later = False
        self.retune_candidates: list[Any] = []  # preheat.cache.retune.Candidate, in the order hit
        if mode in ("full", "xla"):
            xla_layer.configure_persistent_cache(self.root)

    def get_or_compile(self, fingerprint: dict[str, Any], sig: Any, program: Callable[..., Any], args: Any,
                       outputs: int = 1) -> tuple[Any, Timings]:
        """``fingerprint``: the model component's identity (architecture, never weights);
        ``program(args)``: one argument, a stage's NamedTuple (``preheat.families.stages``);
        ``outputs``: 1 when the program returns one array, k for a k-tuple of arrays."""
        fields = self.fields_for(fingerprint, sig, args)
        key = key_of(fields)
        record: dict[str, Any] = {"key": key, "stage": getattr(sig, "stage", "denoise")}
        prefetched = self._take_prefetched(key, record)
        if prefetched is not None:
            compiled, waited = prefetched
            if compiled is not None:  # loaded (or compiled) in the background: only the wait is on this path
                timings = Timings(trace_lower_s=record.pop("background_trace_lower_s", 0.0), compile_s=waited,
                                  cache_layer=record.pop("background_layer", "aot"))
                self._note(record, timings)
                return self._maybe_retune(key, sig, program, args, compiled, record), timings
            # the background load missed or failed (quarantined): compile, as a miss here would
        elif self.mode == "full":
            start = time.perf_counter()
            compiled = self._load(key, fields, args, record, outputs)
            if compiled is not None:
                timings = Timings(trace_lower_s=0.0, compile_s=time.perf_counter() - start, cache_layer="aot")
                self._note(record, timings)
                return self._maybe_retune(key, sig, program, args, compiled, record), timings
            record["miss"] = self._explain_miss(fields)

        compiled, timings = self._compile(key, fields, program, args, record)
        self._note(record, timings)
        return compiled, timings

    def _compile(self, key: str, fields: dict[str, Any], program: Callable[..., Any], args: Any,
                 record: dict[str, Any]) -> tuple[Any, Timings]:
        """Trace, lower and compile ``program`` (a miss), and store it in full mode."""
        start = time.perf_counter()
        lowered = jax.jit(program).lower(args)
        traced = time.perf_counter()
        hits_before = xla_layer.hit_count()
        guarded = self.mode == "full" and serialise_guard(fields)
        if guarded:
            # An executable that XLA:CPU loaded from JAX's persistent cache serialises into an entry
            # that fails at run time (the NOT_FOUND errors quoted in ``preheat.cache.xla_layer``;
            # docs/cache.md). So in full mode, where the aot layer serves every later start, the
            # program is compiled fresh here and serialised; JAX's cache is the whole story in "xla"
            # mode, and serves the process's other compiles in both. Where the guard is off
            # (``serialise_guard``), full mode compiles through JAX's cache like "xla" mode and
            # stores what it returns. (The same compile as a ``cache="off"`` load's, through the one
            # function both call: tests/_support/compile_memo.py serves both from one memo.)
            compiled = xla_layer.compile_uncached(lowered)
        else:
            with xla_layer.persistent_cache_at(self.root):  # this load's root, whichever one the process used before
                compiled = lowered.compile()
        done = time.perf_counter()
        layer = "xla" if xla_layer.hit_count() > hits_before else "none"
        timings = Timings(trace_lower_s=traced - start, compile_s=done - traced, cache_layer=layer)
        if guarded and layer == "xla":  # must not happen (see above); never store such a program
            record["store"] = "skipped: the executable came from JAX's persistent cache"
        elif self.mode == "full":
            self._store(key, fields, compiled, record)
        return compiled, timings

    def _maybe_retune(self, key: str, sig: Any, program: Callable[..., Any], args: Any, served: Any,
                      record: dict[str, Any]) -> Any:
        """With ``retune`` on, on a backend that autotunes: an entry that was not autotuned gets an
        autotuned compile, and the faster of the two serves and stays (``preheat.cache.retune``).
        With ``retune_later`` on, such an entry serves as it is and is remembered for later."""
        if not (self.retune or self.retune_later):
            return served
        from preheat.cache import retune

        path = self.kind_dir / key
        try:
            manifest = json.loads((path / "manifest.json").read_text())
        except (OSError, ValueError):
            return served
        if not retune.needs_retune(manifest):
            return served
        if not self.retune:
            self.retune_candidates.append(retune.Candidate(key, path, sig, program, args, served))
            return served
        chosen, record["retune"] = retune.retune_now(path, served, program, args, self.compile_autotuned)
        return chosen

    def compile_autotuned(self, program: Callable[..., Any], args: Any) -> tuple[Any, dict[str, bytes]]:
        """``program`` compiled afresh on the local devices (where XLA autotunes), never from JAX's
        persistent cache, and its entry's files (the serialized executable)."""
        from preheat.cache.serialized import serialize

        with xla_layer.persistent_cache_disabled():
            autotuned = jax.jit(program).lower(args).compile()
        return autotuned, {EXECUTABLE: serialize(autotuned)}

    def start_early(self, startup_id: str, mesh: Any = None) -> None:
        """Begin deserialising the executables the last start with ``startup_id`` prefetched (see
        ``preheat.cache.early``), before the model is built; the prefetch then remembers its keys."""
        if self.mode != "full":
            return
        from preheat.cache.early import EarlyLoads, remembered

        self._startup_id = startup_id
        keys = [k for k in remembered(self.root, startup_id) if (self.kind_dir / k / "manifest.json").is_file()]
        if keys:
            devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
            self._early = EarlyLoads(self.kind_dir, keys, devices)

    def fields_for(self, fingerprint: dict[str, Any], sig: Any, args: Any) -> dict[str, Any]:
        """The key fields of a program as this compiler compiles it (``key_fields``)."""
        return key_fields(fingerprint, sig, args)

    def manifest_extra(self) -> dict[str, Any]:
        """What an entry records beside its key: the target it was compiled for ("local": the
        devices that ran the compile) and whether XLA autotuned it (GPUs autotune by default)."""
        return {"preheat": __version__, "target": "local", "autotuned": platforms.local().autotunes}

    def prefetch(self, items: Items | Callable[[], Items], phases: Any = None) -> "Prefetch":
        """Start loading (or pulling) the executables of ``items`` -- (fingerprint, signature,
        arguments, outputs), the arguments' shapes enough (``jax.ShapeDtypeStruct`` weights) --
        on a background thread; ``get_or_compile`` takes a loaded one when its key comes up. A
        failed load is quarantined as on the main path, and that key is compiled instead.
        ``items`` may be a function that returns them: it then runs on the thread too (a text
        family traces its encoders for their output shapes: that overlaps the weight reads).
        ``phases`` (``preheat.timings.Phases``): where the thread's phases are recorded."""
        if self.mode != "full" or not items:
            self._prefetch = None
            return Prefetch(self, [], phases)
        self._prefetch = Prefetch(self, items, phases, background_compiles())  # a bad setting fails here, in one line
        self._prefetch.start()
        return self._prefetch

    def _take_prefetched(self, key: str, record: dict[str, Any]) -> tuple[Any, float] | None:
        """(executable or None, seconds waited) when ``key`` was prefetched; None when it was not
        (or the background thread failed unexpectedly: the normal path then runs)."""
        job = self._prefetch
        if job is None:
            return None
        job.keys_ready.wait()
        if key not in job.keys:
            return None
        from preheat.timings import now_s

        start = now_s()
        job.wait()
        end = now_s()
        if job.phases is not None:
            job.phases.add("first_call.wait_executable", start, end)
        job.keys.pop(key, None)  # taken once: a later compile of this key (after reject()) is a normal one
        result = job.results.pop(key, None)
        if result is None:  # the thread died before this key: load it here
            record["prefetch"] = f"failed: {job.error}" if job.error else "not reached"
            return None
        compiled, background = result
        record.update({k: v for k, v in background.items() if k not in record}, prefetch="background",
                      background_load_s=background.get("background_load_s"))
        return compiled, end - start

    def reject(self, fingerprint: dict[str, Any], sig: Any, args: Any, reason: str) -> None:
        """Quarantine the entry that served ``sig`` (it loaded but failed to run)."""
        key = key_of(self.fields_for(fingerprint, sig, args))
        record: dict[str, Any] = {"key": key, "stage": getattr(sig, "stage", "denoise")}
        self._quarantine(self.kind_dir / key, reason, record)
        self.events.append(record)

    # ------------------------------------------------------------------ internals

    def _load(self, key: str, fields: dict[str, Any], args: Any, record: dict[str, Any], outputs: int = 1) -> Any:
        from preheat.cache.serialized import deserialize_and_load  # jax's, keeping the step reports

        in_tree = jax.tree_util.tree_structure(((args,), {}))  # program(args): one positional argument
        out_tree = jax.tree_util.tree_structure(0 if outputs == 1 else tuple(range(outputs)))
        if self._early is not None:  # deserialised at process start from the last start's guess
            compiled = self._early.take(key, fields, in_tree, out_tree)
            if compiled is not None:
                record["early"] = True
                return compiled
        path = self.kind_dir / key
        if not path.is_dir():
            # Local miss: pull the entry from the fleet's shared store. fetch() verifies it and
            # publishes it locally with the same atomic rename; it never raises for store trouble.
            if not self._pull(key, record):
                return None
        try:
            entry = checked_entry(self.kind_dir, key, fields)
        except CacheEntryError as err:
            self._quarantine(path, str(err), record)
            return None
        if entry is None:
            return None
        reason = unrunnable(entry.manifest)
        if reason:  # a GPU fails it at its first run: not worth the load (docs/gpu.md)
            self._quarantine(path, f"compiled without a GPU for {_target_name(entry.manifest)}, which will not "
                                   f"run it: {reason}", record)
            return None
        payload = entry.file(EXECUTABLE).read_bytes()
        mesh = mesh_of(args)  # the key's mesh field: the same device ids the entry was compiled for
        devices = _single_device(args) if mesh is None else list(mesh.devices.flat)
        try:
            with LoadingMarker(path):
                compiled = deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        except Exception as exc:  # a deserialisation failure is a miss, never a crash
            self._quarantine(path, f"deserialisation failed: {type(exc).__name__}: {str(exc)[:200]}", record)
            return None
        entry.record_hit()
        return compiled

    def _store(self, key: str, fields: dict[str, Any], compiled: Any, record: dict[str, Any],
               extra: dict[str, Any] | None = None) -> None:
        from preheat.cache.serialized import serialize  # jax's, keeping the step reports

        try:
            payload = serialize(compiled)
        except Exception as exc:  # some backends cannot serialise; the xla layer still helps
            log.warning("preheat cache: cannot serialise this executable (%s); only the XLA cache is used", exc)
            record["store"] = f"not serialisable: {exc}"
            return
        self._publish(key, {EXECUTABLE: payload}, fields, record, extra)


class TargetCompiler(JaxCompiler):
    """Compiles each program for a GPU this machine does not have (``preheat warm --target``):
    lowered onto the target's compile-only device (``preheat.cache.targets.target_device``),
    compiled there, serialised and stored -- and pushed to the fleet's store -- under the key a
    pod with that GPU computes for itself. Nothing runs: the engine compiles each stage of a
    described call (``compile_described``), and an entry already there is not compiled again (its
    "executable" is None). Entries record their target and that XLA did not autotune them (a
    deviceless compile cannot time kernels)."""

    runs = False

    def __init__(self, target: Any, root: Path | None = None, remote: Any = "env"):
        from preheat.cache.targets import target_device

        self.target = target
        self.device = target_device(target)  # no plugin / a description XLA refuses: one line, before any work
        super().__init__(root=root, mode="full", remote=remote)

    def fields_for(self, fingerprint: dict[str, Any], sig: Any, args: Any) -> dict[str, Any]:
        return key_fields(fingerprint, sig, args, target=self.target)

    def manifest_extra(self) -> dict[str, Any]:
        return {"preheat": __version__, "target": self.target.manifest(), "autotuned": False}

    def prefetch(self, items: Items | Callable[[], Items], phases: Any = None) -> "Prefetch":
        self._prefetch = None  # nothing is loaded here: the entries are for another machine
        return Prefetch(self, [], phases)

    def get_or_compile(self, fingerprint: dict[str, Any], sig: Any, program: Callable[..., Any], args: Any,
                       outputs: int = 1) -> tuple[Any, Timings]:
        fields = self.fields_for(fingerprint, sig, args)
        key = key_of(fields)
        record: dict[str, Any] = {"key": key, "stage": getattr(sig, "stage", "denoise"), "target": self.target.name}
        compiled = None
        if (self.kind_dir / key / "manifest.json").is_file():
            timings = Timings(trace_lower_s=0.0, compile_s=0.0, cache_layer="aot")
        else:
            start = time.perf_counter()
            # the models' trace-time choices: the target's platform's
            with platforms.compiling_for(self.target.platform, self.target.capability):
                lowered = jax.jit(program).lower(on_device(args, self.device))
            traced = time.perf_counter()
            with xla_layer.persistent_cache_disabled():
                try:
                    compiled = lowered.compile()
                except Exception as exc:  # e.g. more memory than the target has: one line naming the program
                    if "RESOURCE_EXHAUSTED" not in str(exc):
                        raise
                    first = str(exc).splitlines()[0].split("RESOURCE_EXHAUSTED: ", 1)[-1][:240]
                    raise TargetError(f"--target {self.target.name}: the {record['stage']} program does not fit "
                                      f"it: {first}", reason="memory") from None
            timings = Timings(trace_lower_s=traced - start, compile_s=time.perf_counter() - traced, cache_layer="none")
            reason = unrunnable_cudnn_calls(compiled)
            if reason:
                record["unrunnable"] = reason
            self._store(key, fields, compiled, record, {UNRUNNABLE: reason} if reason else None)
        self._note(record, timings)
        return compiled, timings


# Why a host stage (``preheat.load(encoders_on="host")``) is not compiled for a target.
HOST_STAGE = "runs on the target machine's own CPU, which a builder cannot compile for: compiled there"


def left_to_target(compiler: Any, stage: Any) -> bool:
    """Whether ``compiler`` leaves ``stage`` to the machine that runs it (``HOST_STAGE``): a host
    stage under a compiler whose executables are for another machine."""
    return compiler is not None and not compiler.runs and stage.on_host


def compile_described(compiler: JaxCompiler, calls: Iterable[list[Any]], program: Callable[[Any], Callable[..., Any]],
                      at_once: Optional[int] = None,
                      each: Callable[[int, list[dict[str, Any]]], None] = lambda i, records: None) -> None:
    """Compile (or find) every stage of ``calls`` (each the ``Pipeline.describe`` of one call; from a
    generator, the later calls are described while the first compile), ``program(stage)`` being the
    function a stage compiles (``Pipeline.program``), running none: what a compiler whose
    executables are for another machine builds (``preheat warm --target``). Each
    program compiles once, up to ``at_once`` at once (default ``PREHEAT_BACKGROUND_COMPILES``; XLA's
    compiles release the GIL, so a builder's cores take the encoders, the loops and the decoders
    together). Under such a compiler a host stage is left out (``HOST_STAGE``). ``each(i,
    records)`` is called in order as call ``i``'s programs are ready: the compiler's records
    ("stage", "key", "layer", "trace_lower_s", "compile_or_load_s"[, "unrunnable"]), or {"stage",
    "skipped"}. The first failure (a program larger than the target: one line) cancels what has not
    started and is raised."""
    from concurrent.futures import ThreadPoolExecutor

    jobs: dict[str, Any] = {}  # key -> its compile: a program two calls share compiles once
    keyed: list[list[tuple[str, Optional[str]]]] = []  # per call: (stage, key; None: left out)
    with ThreadPoolExecutor(max(1, background_compiles() if at_once is None else at_once),
                            thread_name_prefix="preheat-compile") as pool:
        try:
            for stages in calls:
                keyed.append([])
                for stage in stages:
                    key = None if left_to_target(compiler, stage) else \
                        key_of(compiler.fields_for(stage.fingerprint, stage.sig, stage.args))
                    if key is not None and key not in jobs:
                        jobs[key] = pool.submit(compiler.get_or_compile, stage.fingerprint, stage.sig,
                                                program(stage), stage.args, outputs=stage.outputs)
                    keyed[-1].append((stage.name, key))
            for i, programs in enumerate(keyed):
                for _, key in programs:
                    if key is not None:
                        jobs[key].result()
                records = {e["key"]: e for e in compiler.events if "key" in e}
                each(i, [{"stage": name, "skipped": HOST_STAGE} if key is None else
                         records.get(key, {"stage": name, "key": key}) for name, key in programs])
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _target_name(manifest: dict[str, Any]) -> str:
    target = manifest.get("target")
    return str(target.get("name") if isinstance(target, dict) else target)


def on_device(args: Any, device: Any) -> Any:
    """``args`` (any pytree) as abstract values placed on ``device`` (shapes, dtypes, weak types and
    memory kinds kept -- offloaded encoders' weights are in host memory: the executable's inputs must
    be what the pod will pass)."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def one(leaf: Any) -> jax.ShapeDtypeStruct:
        aval = leaf if isinstance(leaf, jax.ShapeDtypeStruct) else jax.typeof(leaf)
        kind = getattr(getattr(leaf, "sharding", None), "memory_kind", None)
        placed = sharding if kind is None else sharding.with_memory_kind(kind)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=placed, weak_type=aval.weak_type)

    return jax.tree.map(one, args)


class Prefetch:
    """Executables loading on a background thread (``JaxCompiler.prefetch``)."""

    def __init__(self, compiler: JaxCompiler, items: Items | Callable[[], Items], phases: Any, at_once: int = 0):
        self.compiler, self.items, self.phases = compiler, items, phases
        self.at_once = at_once  # misses compiled at once on this prefetch's threads (0: on the first call)
        self.keys: dict[str, tuple] = {}  # computed on the thread (hashing the traced sources is not free)
        self.keys_ready = threading.Event()
        self.results: dict[str, tuple[Any, dict[str, Any]]] = {}
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="preheat-executable-prefetch", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self.items:
            self.keys_ready.set()

    def wait(self) -> None:
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()

    def _compile_misses(self, misses: list[tuple[str, dict[str, Any], Any, Any, dict[str, Any]]], at_once: int) -> None:
        """Compile the programs no cache held, up to ``at_once`` at once: a cold start's
        stages, which the first call would otherwise compile one after another. One that fails here
        is left to the first call, which compiles it on its own path (and says why it failed)."""
        from concurrent.futures import ThreadPoolExecutor
        from preheat.timings import now_s

        def one(key: str, fields: dict[str, Any], program: Any, args: Any, record: dict[str, Any]) -> None:
            try:
                compiled, timings = self.compiler._compile(key, fields, program, args, record)
            except Exception as exc:  # never a crash: the first call compiles it
                record["background_compile"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                return
            record.update(background_compile="done", background_layer=timings.cache_layer,
                          background_trace_lower_s=timings.trace_lower_s, background_compile_s=timings.compile_s)
            self.results[key] = (compiled, record)

        if not misses or at_once < 1:
            return
        start = now_s()
        with ThreadPoolExecutor(min(at_once, len(misses)), thread_name_prefix="preheat-compile") as pool:
            for job in [pool.submit(one, *m) for m in misses]:
                job.result()
        if self.phases is not None:
            self.phases.add("executable.compile", start, now_s())

    def _run(self) -> None:
        from preheat.timings import now_s

        start = now_s()
        try:
            try:
                items = self.items() if callable(self.items) else self.items
                if self.phases is not None and callable(self.items):
                    self.phases.add("executable.keys", start, now_s())
                for fingerprint, sig, args, outputs, *program in items:
                    fields = self.compiler.fields_for(fingerprint, sig, args)
                    self.keys[key_of(fields)] = (fields, args, outputs, getattr(sig, "stage", "denoise"),
                                                 program[0] if program else None)
            finally:
                self.keys_ready.set()
            if self.compiler._startup_id is not None:  # the next start's guess (preheat.cache.early)
                from preheat.cache.early import remember

                remember(self.compiler.root, self.compiler._startup_id, list(self.keys))
            misses = []
            for key, (fields, args, outputs, stage, program) in list(self.keys.items()):
                record: dict[str, Any] = {"key": key, "stage": stage}
                t0 = time.perf_counter()
                pulled = [now_s()]
                compiled = self.compiler._load(key, fields, args, record, outputs)
                record["background_load_s"] = time.perf_counter() - t0
                if "remote_s" in record and self.phases is not None:
                    self.phases.add("executable.pull", pulled[0], pulled[0] + record["remote_s"])
                if compiled is None and "quarantined" not in record:
                    record["miss"] = self.compiler._explain_miss(fields)
                self.results[key] = (compiled, record)
                if compiled is None and program is not None:
                    misses.append((key, fields, program, args, record))
            self._compile_misses(misses, self.at_once)
            if self.compiler._early is not None:
                self.compiler._early.drop()  # guesses nobody asked for
        except Exception as exc:  # never a crash: the first call loads or compiles on its own
            self.error = f"{type(exc).__name__}: {str(exc)[:200]}"
            log.warning("preheat cache: background executable load failed (%s); the first call loads or compiles",
                        self.error)
        finally:
            if self.phases is not None:
                self.phases.add("executable", start, now_s())
