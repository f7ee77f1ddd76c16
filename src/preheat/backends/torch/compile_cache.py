"""The torch compile cache: torch.compile (Inductor) artifacts and AOTInductor packages as
preheat cache entries, under ``<root>/compile/torch/<key>/``.

Same rules as the JAX cache (``preheat.cache.compile``), by calling the same functions:
an entry is published atomically with a sha256 manifest (``publish_entry``), verified on every
read (``open_entry``), moved to ``<root>/quarantine/`` when bad (``quarantine``), and guarded by
a ``LoadingMarker`` while it is loaded, so a load that kills the process quarantines the entry
on the next start. A bad entry means a recompile, never an error to the user. With
``PREHEAT_CACHE_URL`` set, a local miss is pulled from the fleet store (verified, signed) and
every entry written is pushed to it from a background thread, as on the JAX side (kind
``torch``; see ``TorchCompiler.defer_pushes``).

Two kinds of entry (``fields["mode"]``):

``inductor``  ``mega.bin``: ``torch.compiler.save_cache_artifacts()`` after the first (warm-up)
              call, loaded with ``torch.compiler.load_cache_artifacts`` before it; plus
              ``kernels.tar``: the C++ kernel libraries Inductor built for CPU. Mega-Cache
              bundles Triton kernels (GPU) but not CPU C++ kernels, which would otherwise be
              recompiled in every fresh process (most of the compile time on CPU). Dynamo
              still traces on a hit (``trace_lower_s`` stays); cache_layer ``"mega"``.
``aot``       ``model.pt2``: the UNet forward exported with ``torch.export`` (static shapes) and
              packaged by AOTInductor **without its weights**
              (``aot_inductor.package_constants_in_so=False``); loaded and bound to the
              pipeline's own parameters with
              ``load_constants(..., user_managed=True)``. No Dynamo, no Inductor on a hit, and
              every fine-tune of one architecture shares one package; cache_layer ``"aot"``.
              A hit loads the package with torch's C++ loader directly (``AotRunner``), not
              ``aoti_load_package``: that one first compares the device with the package's
              metadata, which on CPU means building and running instruction-set probe
              libraries with g++ (27 s in a fresh process on the loaded 2-core box, 2.7 s with
              the probes restored from a bundle), only to log a warning on a mismatch. The key
              already holds the CPU's instruction sets (or the GPU's name and capability), so
              the probe cannot disagree with a hit; loading takes milliseconds. (Entries
              written before this held the probes as ``kernels.tar``; they are still read.)

Bundled kernels are the ``.so`` files that appear in ``<TORCHINDUCTOR_CACHE_DIR>/<2 chars>/``
during the compile (plus the ones Inductor loads). Where that folder already held them (a
machine that compiled before), they are not new and not bundled; a fresh machine then builds
them once at load.

Key: torch / CUDA / HIP / triton / diffusers versions, device and its name (host CPU model,
instruction-set flags and torch's thread count on CPU), the UNet architecture (config.json minus bookkeeping), the
shapes the UNet sees (the model batch: doubled under classifier-free guidance; image size),
dtype, compile options, ``TORCHINDUCTOR_*`` settings and Inductor settings changed in Python,
preheat's version and the source of the code traced here. Never the weights. Every model batch
and image size is its own entry. (``preheat.torch.compile`` keys any module the same way, with
its input signature as the shapes: see ``preheat.backends.torch.compiled``.)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from preheat._version import __version__
from preheat.files import atomic_write_bytes
from preheat.cache.entries import SCHEMA, Entry, LoadingMarker, checked_entry
from preheat.cache.entry_cache import EntryCache
from preheat.env import installed_version
from preheat.errors import CacheEntryError, InvalidArgumentError
from preheat.timings import Timings

__all__ = ["TorchCompiler", "make_compiler", "torch_key_fields", "inductor_config_changes", "INDUCTOR_OPTIONS", "AOT_INDUCTOR_CONFIGS", "CACHE_MODES"]

log = logging.getLogger("preheat.cache")

MEGA = "mega.bin"
KERNELS = "kernels.tar"
PACKAGE = "model.pt2"

# torch.compile options (also part of the key)
INDUCTOR_OPTIONS: dict[str, Any] = {"backend": "inductor", "dynamic": False, "fullgraph": False, "mode": None}
# AOTInductor options: weights stay out of the package and are bound at load time. Without
# always_keep_tensor_constants, Inductor inlines every 1-D parameter of <= 8 elements into the
# kernel code as literals (GraphLowering.can_inline_constant: e.g. the conv_out bias of an RGB
# model); a package built so would silently keep those values for every other checkpoint.
AOT_INDUCTOR_CONFIGS: dict[str, Any] = {"aot_inductor.package_constants_in_so": False,
                                        "always_keep_tensor_constants": True}
AOT_EXPORT_OPTIONS: dict[str, Any] = {"strict": False}

# "full": preheat entries (+ torch's own local caches); "local": torch's own caches only; "off";
# "explain": compile nothing, run eagerly, and record for each key whether an entry would serve it
# (``preheat cache explain --backend torch``)
CACHE_MODES = ("full", "local", "off", "explain")


def _source_hash() -> str:
    """The code traced into compiled graphs besides diffusers': this package's modules."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in ("pipeline.py", "compile_cache.py"):
        h.update(name.encode())
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def device_description(device: Any) -> dict[str, Any]:
    """What the compiled code depends on about the device it runs on."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {"device": "cuda", "device_name": props.name, "capability": f"{props.major}.{props.minor}"}
    if dev.type == "cpu":
        from preheat.platforms import cpu_features

        # Inductor's C++ codegen depends on the thread count (serial kernels at 1, OpenMP otherwise;
        # its parallel split heuristics use it), so a different count is a different program
        return {"device": "cpu", "device_name": cpu_features(), "threads": torch.get_num_threads()}
    return {"device": dev.type, "device_name": str(dev)}


# Inductor settings torch itself writes while compiling (not a user's choice, so not in the key):
# AOTInductor fills the package's metadata dict (device, platform, CPU ISA) in place.
_RUNTIME_STATE = frozenset({"aot_inductor.metadata"})


def inductor_config_changes() -> dict[str, Any]:
    """Inductor settings (``torch._inductor.config``) that differ from torch's defaults and are
    not marked compile-ignored: what a user set in Python rather than through the environment."""
    try:
        import torch._inductor.config as cfg

        entries = cfg._config
        ignored = set(cfg._compile_ignored_keys)
    except (ImportError, AttributeError):  # pragma: no cover - another torch layout
        return {}
    changed = {}
    for name, entry in sorted(entries.items()):
        if name.startswith("_") or name in ignored or name in _RUNTIME_STATE:
            continue
        value = getattr(cfg, name, None)
        if value != entry.default:
            plain = value is None or isinstance(value, (bool, int, float, str, list, dict, tuple))
            changed[name] = value if plain else type(value).__qualname__  # never a repr with an address
    return changed


def torch_key_fields(fingerprint: dict[str, Any], *, mode: str, dtype: str, device: Any,
                     model_batch: int | None = None, sample_chw: tuple[int, int, int] | None = None,
                     class_conditional: bool = False, shapes: dict[str, Any] | None = None,
                     options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every input that changes the compiled model, as JSON-able fields (the key's content).

    ``shapes``: what the compiled code was called with (``preheat.torch.compile``'s input
    signature); by default the UNet's (model batch, sample C/H/W, class labels).
    ``options``: the compile options; by default ``INDUCTOR_OPTIONS`` or the AOTInductor ones."""
    import diffusers
    import torch

    if options is None:
        options = dict(INDUCTOR_OPTIONS) if mode == "inductor" else {**AOT_INDUCTOR_CONFIGS, **AOT_EXPORT_OPTIONS}
    if shapes is None:
        assert model_batch is not None and sample_chw is not None
        shapes = {"model_batch": int(model_batch), "sample": [int(s) for s in sample_chw],
                  "class_labels": bool(class_conditional)}
    fields = {
        "schema": SCHEMA,
        "backend": "torch",
        "mode": mode,
        "model": fingerprint,
        "shapes": shapes,
        "dtype": dtype,
        **device_description(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "triton": installed_version("triton") or installed_version("pytorch-triton-rocm"),
        "diffusers": diffusers.__version__,
        "compile_options": options,
        "inductor_config": inductor_config_changes(),
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith("TORCHINDUCTOR_") and k != "TORCHINDUCTOR_CACHE_DIR"},
        "preheat": __version__,
        "source": _source_hash(),
    }
    return json.loads(json.dumps(fields, default=str))  # exactly what a manifest reads back


def _inductor_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def _compile_metrics() -> dict[str, float]:
    """Cumulative Dynamo / backend compile seconds of this process (0 when unavailable)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover - other torch versions
        return {}
    return {k: float(sum(v)) for k, v in compilation_time_metrics.items()
            if k in ("_compile.compile_inner", "OutputGraph.call_user_compiler")}


def _kernel_files() -> set[str]:
    """C++ libraries in Inductor's code cache: ``<cache dir>/<2 characters>/<hash>.so``."""
    base = _inductor_cache_dir()
    return {os.fspath(p) for p in base.glob("??/*.so")} if base.is_dir() else set()


class _KernelRecorder:
    """The C++ kernel libraries (CPU) a compile used: those Inductor loads, plus every library
    created meanwhile (Inductor's instruction-set probes are built and loaded in subprocesses)."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self._before: set[str] = set()
        self._saved: Any = None

    @property
    def paths(self) -> list[str]:
        loaded = {p for p in self.loaded if len(Path(p).parent.name) == 2}
        return sorted(loaded | (_kernel_files() - self._before))

    def __enter__(self) -> "_KernelRecorder":
        self._before = _kernel_files()
        try:
            from torch._inductor.codecache import CppCodeCache
        except ImportError:  # pragma: no cover
            return self
        original = CppCodeCache.__dict__.get("_load_library")
        if not isinstance(original, classmethod):  # pragma: no cover - another torch layout
            return self
        recorder, inner = self, original.__func__

        def _load_library(cls: Any, path: str, key: str) -> Any:
            recorder.loaded.append(os.fspath(path))
            return inner(cls, path, key)

        CppCodeCache._load_library = classmethod(_load_library)
        self._saved = (CppCodeCache, original)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is not None:
            cls, original = self._saved
            cls._load_library = original
            self._saved = None


@contextlib.contextmanager
def _no_header_precompile() -> Any:
    """While the kernels of a hit load: no precompiled C++ header. Inductor preprocesses (and, on
    a fresh machine, precompiles) its CPU prefix header before it even looks for a kernel's
    library, though every library came with the entry; a kernel that did not would be built
    without the header (slower to build, the same code)."""
    try:
        from torch._inductor import codecache
    except ImportError:  # pragma: no cover
        yield
        return
    original = getattr(codecache, "_precompile_header", None)
    if original is None:  # pragma: no cover - another torch layout
        yield
        return
    codecache._precompile_header = lambda *args, **kwargs: None
    try:
        yield
    finally:
        codecache._precompile_header = original


def _pack_kernels(paths: list[str]) -> bytes:
    """A tar of the given kernel libraries, named relative to Inductor's cache folder."""
    base = _inductor_cache_dir().resolve()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        seen = set()
        for p in paths:
            path = Path(p).resolve()
            try:
                rel = path.relative_to(base)
            except ValueError:
                continue
            if rel.as_posix() in seen or not path.is_file():
                continue
            seen.add(rel.as_posix())
            tar.add(path, arcname=rel.as_posix(), recursive=False)
    return buf.getvalue()


def _restore_kernels(data: bytes) -> int:
    """Write the bundled kernel libraries into Inductor's cache folder (atomically, never over
    an existing file). Returns how many were written. Raises CacheEntryError on an unsafe tar."""
    base = _inductor_cache_dir()
    written = 0
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r")
    except tarfile.TarError as exc:
        raise CacheEntryError(f"kernel bundle is not a tar ({exc})") from None
    with tar:
        for member in tar.getmembers():
            name = member.name
            parts = Path(name).parts
            if not member.isfile() or name.startswith("/") or ".." in parts or not name.endswith(".so"):
                raise CacheEntryError(f"kernel bundle holds an unsafe member {name!r}")
            dest = base / name
            if dest.exists():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            if src is None:
                raise CacheEntryError(f"kernel bundle member {name!r} is unreadable")
            atomic_write_bytes(dest, src.read(), mode=0o755)  # shared objects must be executable
            written += 1
    return written


class TorchCompiler(EntryCache):
    """Loads and stores compiled UNets for a ``TorchPipeline``; ``events`` records one dict per
    compile or load (key, mode, layer, timings, miss reason, quarantine reason, store result).

    ``mode``: "full" (preheat entries on top of torch's own caches), "local" (torch's own local
    caches only: no entries are read or written), "off" (torch's caches disabled too)."""

    def __init__(self, root: Path | None = None, mode: str = "full", remote: Any = "env", background: bool = True):
        super().__init__("torch", root, mode, remote)
        if background:  # uploads off the compiling thread (``EntryCache.defer_pushes``)
            self.defer_pushes()

    @property
    def uses_entries(self) -> bool:
        return self.mode == "full"

    @staticmethod
    def device_type(fields: dict[str, Any]) -> str:
        return str(fields.get("device", "cpu"))

    # ------------------------------------------------------------------ explain

    @property
    def explains(self) -> bool:
        return self.mode == "explain"

    def explain(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Would an entry serve ``fields``? Records (and returns) an event: ``explain`` "hit" or
        "miss", and on a miss which key fields differ from the nearest local entry (torch /
        triton / CUDA version, GPU kind, Inductor options, dynamic, the input signature, ...)."""
        from preheat.cache.entry_cache import nearest_entry
        from preheat.cache.keys import key_of

        key = key_of(fields)
        record: dict[str, Any] = {"key": key, "mode": fields.get("mode"), "fields": fields, "layer": "explain"}
        if (self.kind_dir / key / "manifest.json").is_file():
            record["explain"] = "hit"
        else:
            name, diff = nearest_entry(self.kind_dir, fields)
            record.update(explain="miss", nearest=name, differs=diff)
        self.events.append(record)
        return record

    # ------------------------------------------------------------------ torch.compile (Inductor)

    def warm_inductor(self, fields: dict[str, Any], warm_up: Callable[[], Any]) -> Any:
        """Run ``warm_up`` (the first call of the torch.compile'd UNet at these shapes) with the
        cache entry loaded first; store the artifacts after a fresh compile. Returns Timings."""
        import torch
        import torch._dynamo  # noqa: F401  (torch #154463: without it save_cache_artifacts returns None)

        from preheat.cache.keys import key_of

        key = key_of(fields)
        record: dict[str, Any] = {"key": key, "mode": "inductor"}
        load_failed = False
        if self.uses_entries:
            entry = self._open(key, fields, record)
            if entry is not None:
                start = time.perf_counter()
                before = _compile_metrics()
                try:
                    with LoadingMarker(entry.path):
                        _restore_kernels(entry.file(KERNELS).read_bytes())
                        torch.compiler.load_cache_artifacts(entry.file(MEGA).read_bytes())
                        loaded = time.perf_counter()
                        with _no_header_precompile():
                            warm_up()
                except Exception as exc:  # a bad entry is a recompile, never an error
                    self._quarantine(entry.path, f"load failed: {type(exc).__name__}: {str(exc)[:200]}", record)
                    torch._dynamo.reset()
                    load_failed = True  # what it put in torch's local caches must not be reused
                else:
                    entry.record_hit()
                    timings = self._inductor_timings(before, start, loaded, time.perf_counter(), "mega")
                    self._note(record, timings)
                    return timings
        start = time.perf_counter()
        before = _compile_metrics()
        no_caches = self.mode == "off" or load_failed
        ctx = torch._inductor.config.patch(force_disable_caches=True) if no_caches else contextlib.nullcontext()
        with ctx, _KernelRecorder() as recorder:
            warm_up()
        timings = self._inductor_timings(before, start, start, time.perf_counter(), "none")
        if self.uses_entries:
            self._store_inductor(key, fields, recorder.paths if self.device_type(fields) == "cpu" else [], record)
        self._note(record, timings)
        return timings

    @staticmethod
    def _inductor_timings(before: dict[str, float], start: float, loaded: float, end: float, layer: str) -> Any:

        after = _compile_metrics()
        dynamo = after.get("_compile.compile_inner", 0.0) - before.get("_compile.compile_inner", 0.0)
        backend = after.get("OutputGraph.call_user_compiler", 0.0) - before.get("OutputGraph.call_user_compiler", 0.0)
        load_s = loaded - start
        if dynamo <= 0.0:  # no metrics: the whole warm-up counts as compile
            return Timings(trace_lower_s=0.0, compile_s=end - start, cache_layer=layer)
        return Timings(trace_lower_s=max(dynamo - backend, 0.0), compile_s=backend + load_s, cache_layer=layer)

    def _store_inductor(self, key: str, fields: dict[str, Any], kernel_paths: list[str],
                        record: dict[str, Any]) -> None:
        import torch

        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception as exc:  # pragma: no cover - torch internals
            saved = None
            record["store"] = f"save_cache_artifacts failed: {exc}"
        if saved is None:
            record.setdefault("store", "torch returned no cache artifacts (torch #154463)")
            log.warning("preheat cache: %s", record["store"])
            return
        payload, _info = saved
        try:
            kernels = _pack_kernels(kernel_paths)
        except OSError as exc:
            record["store"] = f"could not bundle kernels: {exc}"
            return
        record["kernels"] = len(set(kernel_paths))
        self._publish(key, {MEGA: bytes(payload), KERNELS: kernels}, fields, record)

    # ------------------------------------------------------------------ AOTInductor

    def load_or_build_aot(self, fields: dict[str, Any], module: Any, example: tuple, constants: dict[str, Any],
                          example_kwargs: dict[str, Any] | None = None) -> tuple[Any, Any]:
        """(runner, Timings): the AOTInductor package for ``fields`` from its entry, or exported,
        compiled, stored and loaded. ``constants``: fqn -> tensor, bound as user-managed weights.
        ``example`` / ``example_kwargs``: the call to export (positional / keyword arguments)."""
        import torch

        from preheat.cache.keys import key_of

        key = key_of(fields)
        record: dict[str, Any] = {"key": key, "mode": "aot"}
        if self.uses_entries:
            entry = self._open(key, fields, record)
            if entry is not None:
                start = time.perf_counter()
                try:
                    with LoadingMarker(entry.path):
                        runner = AotRunner(entry.file(PACKAGE))
                        bind_constants(runner, constants)
                except Exception as exc:
                    self._quarantine(entry.path, f"load failed: {type(exc).__name__}: {str(exc)[:200]}", record)
                else:
                    entry.record_hit()
                    timings = Timings(trace_lower_s=0.0, compile_s=time.perf_counter() - start, cache_layer="aot")
                    self._note(record, timings)
                    return runner, timings

        start = time.perf_counter()
        with torch.no_grad():
            exported = torch.export.export(module, tuple(example), kwargs=example_kwargs, **AOT_EXPORT_OPTIONS)
        traced = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="preheat-aoti-") as tmp:
            path = Path(tmp) / PACKAGE
            configs = dict(AOT_INDUCTOR_CONFIGS)
            if self.mode == "off":
                configs["force_disable_caches"] = True
            torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=configs)
            payload = path.read_bytes()
            runner = AotRunner(path)
            bind_constants(runner, constants)
        timings = Timings(trace_lower_s=traced - start, compile_s=time.perf_counter() - traced, cache_layer="none")
        if self.uses_entries:
            self._publish(key, {PACKAGE: payload}, fields, record)
        self._note(record, timings)
        return runner, timings

    # ------------------------------------------------------------------ entries

    def _open(self, key: str, fields: dict[str, Any], record: dict[str, Any]) -> Entry | None:
        path = self.kind_dir / key
        if not path.is_dir():
            self._pull(key, record)  # a local miss: the fleet store's copy, verified
        if not path.is_dir():
            record["miss"] = self._explain_miss(fields)
            return None
        try:
            return checked_entry(self.kind_dir, key, fields)
        except CacheEntryError as err:
            self._quarantine(path, str(err), record)
            return None

class AotRunner:
    """An AOTInductor package, callable like ``aoti_load_package``'s model, loaded by torch's C++
    loader alone: no device probe (see the module docstring), no ``torch._inductor`` import, and
    the call spec read once rather than on every call."""

    def __init__(self, path: str | os.PathLike[str]):
        import torch
        import torch.utils._pytree as pytree

        self.loader = torch._C._aoti.AOTIModelPackageLoader(os.fspath(path), "model", False, 1, -1)
        in_spec, out_spec = self.loader.get_call_spec()
        self.in_spec, self.out_spec = pytree.treespec_loads(in_spec), pytree.treespec_loads(out_spec)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch
        import torch.utils._pytree as pytree
        from torch.export._tree_utils import reorder_kwargs

        flat = pytree.tree_flatten((args, reorder_kwargs(kwargs, self.in_spec)))[0]
        outputs = self.loader.boxed_run([x for x in flat if isinstance(x, torch.Tensor)])
        return pytree.tree_unflatten(outputs, self.out_spec)

    def get_constant_fqns(self) -> list[str]:
        return self.loader.get_constant_fqns()

    def load_constants(self, constants: dict[str, Any], *, check_full_update: bool, user_managed: bool = False) -> None:
        self.loader.load_constants(constants, False, check_full_update, user_managed, False)


def bind_constants(runner: Any, constants: dict[str, Any]) -> None:
    """Give a weight-free AOTInductor package the pipeline's own tensors (no copy)."""
    wanted = runner.get_constant_fqns()
    missing = [name for name in wanted if name not in constants]
    if missing:
        raise CacheEntryError(f"package needs constants the model does not have: {', '.join(missing[:3])}")
    runner.load_constants({name: constants[name] for name in wanted}, check_full_update=True, user_managed=True)


def make_compiler(cache: str | None = None) -> TorchCompiler:
    """The torch compile cache for this process: ``cache`` (or ``$PREHEAT_CACHE``) is "full"
    (default: preheat entries), "xla" / "local" (torch's own local caches only) or "off"."""
    mode = cache or os.environ.get("PREHEAT_CACHE", "full")
    if mode not in ("full", "xla", "local", "off", "explain"):  # explain: for `preheat cache explain`
        raise InvalidArgumentError(f"cache mode {mode!r} is not supported; use full, xla or off", argument="cache")
    mode = "local" if mode == "xla" else mode
    assert mode in CACHE_MODES
    return TorchCompiler(mode=mode)
