"""`preheat bench compare`: one checkpoint on four paths, same sampler, steps, batch and seed.

    jax             preheat's engine (one compiled program per call signature, preheat's cache)
    torch-eager     diffusers' UNet2DModel + diffusers' scheduler, eager PyTorch
    torch-inductor  the same, UNet under torch.compile (Inductor; preheat's Mega-Cache entries)
    torch-aot       the same, UNet exported + AOTInductor package (preheat's entries)

Every measurement runs in fresh child processes (``python -m preheat.bench.compare --child``),
each with a private ``PREHEAT_HOME`` and a private ``TORCHINDUCTOR_CACHE_DIR`` (so torch's own
local caches never carry over between children; only preheat's cache does):

1. cold start, empty cache: ``--repeats`` children, each with a new empty root. The child's own
   age at its first image (``/proc/self/stat`` start time, as ``preheat sample --report``) is
   "process start to first image"; also load, first-call, trace/lower and compile seconds. The
   first of them then primes the cache with the steady-state batch sizes (after measuring).
2. cold start, warm cache: ``--repeats`` children on that primed root.
3. steady state (in the first warm child, after its first image): per batch size one warm-up
   call, then ``--steady-repeats`` timed calls -> per-image seconds (median, min, max) and
   images/s; peak host memory (``ru_maxrss``) and device memory where there is a device.
4. agreement: each path's first-image pixels against torch eager's (same initial noise: both
   backends draw it with JAX's per-image scheme). Only meaningful for a deterministic sampler
   (ddim with eta=0, euler, heun, dpmpp_2m, dpmpp_2m_karras); otherwise reported as null.

Children of one phase run interleaved across paths (round-robin) so that drifting load from
other jobs spreads over all paths. ``--xla-flags NAME=FLAGS`` adds JAX paths run with extra
``XLA_FLAGS`` (e.g. to try XLA:CPU options).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["bench_compare", "markdown", "plot", "PATHS", "QUICK", "FULL", "child_main"]

PATHS = ("jax", "torch-eager", "torch-inductor", "torch-aot")
_TORCH_COMPILE = {"torch-eager": "none", "torch-inductor": "inductor", "torch-aot": "aot"}
RESULT_TAG = "PREHEAT_COMPARE_RESULT "
QUICK = {"repeats": 1, "steady_repeats": 2, "batch_sizes": (1, 8), "steps": 4, "batch": 1}
FULL = {"repeats": 3, "steady_repeats": 5, "batch_sizes": (1, 8, 32), "steps": None, "batch": 8}


# ---------------------------------------------------------------------------------------------
# The child: one fresh process, one path


def _own_model(path: str, torch_model: dict[str, str]) -> dict[str, str]:
    """What ``path`` loads where it is not the common ``model``: a torch path's GGUF file and config."""
    return torch_model if not path.startswith("jax") else {}


def _load_pipe(spec: dict[str, Any]) -> Any:
    base = spec["path"].split("[", 1)[0]
    dtype = {"dtype": spec["dtype"]} if spec.get("dtype") else {}  # every path the same, where one is asked
    if base == "jax":
        import preheat

        return preheat.load(spec["model"], **dtype, **spec.get("companions", {}))
    from preheat.backends.torch import load_torch_pipeline

    config = {"config": spec["config"]} if spec.get("config") else {}  # a GGUF file's config folder
    return load_torch_pipeline(spec["model"], compile=_TORCH_COMPILE[base], **dtype, **config,
                               **spec.get("companions", {}))


def _device_peak_mb(spec: dict[str, Any]) -> float | None:
    if spec["path"].startswith("jax"):
        import jax

        from preheat.platforms import local

        if not local().accelerator:  # the host's memory: no device peak to read
            return None
        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        return None if peak is None else peak / 2**20
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """Load, first image (timed from process start), then optional priming / steady state."""
    from preheat.timings import process_age_s

    out: dict[str, Any] = {"path": spec["path"]}
    t0 = time.perf_counter()
    pipe = _load_pipe(spec)
    out["load_s"] = time.perf_counter() - t0

    from preheat.families.inputs import example_inputs

    def call(n: int) -> Any:
        labels = None if pipe.num_classes is None else [i % pipe.num_classes for i in range(n)]
        specs = pipe.family.input_specs(pipe)  # a second model folder's inputs too
        declared = {*pipe.family.inputs, *(s.name for s in specs)}
        inputs = {k: v for k, v in (spec.get("inputs") or {}).items() if k in declared}
        inputs = {**example_inputs(specs), **inputs}  # a prompt where one is required
        return pipe.generate(n, class_labels=labels, steps=spec["steps"], sampler=spec["sampler"],
                             guidance=spec["guidance"], seed=spec["seed"], **inputs)

    batch = spec["batch"]
    t1 = time.perf_counter()
    pixels = call(batch)
    out["first_call_s"] = time.perf_counter() - t1
    out["process_start_to_first_image_s"] = process_age_s()
    first = pipe.last
    out.update(trace_lower_s=first.trace_lower_s, compile_s=first.compile_s, first_run_s=first.run_s,
               cache_layer=first.cache_layer)
    t2 = time.perf_counter()
    call(batch)
    out["second_call_s"] = time.perf_counter() - t2
    if spec.get("pixels_out"):
        import numpy as np

        np.save(spec["pixels_out"], pixels)

    prime = {}
    for b in spec.get("prime", []):  # fill the cache for the steady-state shapes (not measured)
        t = time.perf_counter()
        call(b)
        prime[str(b)] = {"s": time.perf_counter() - t, "cache_layer": pipe.last.cache_layer}
    if prime:
        out["prime"] = prime

    steady = {}
    for b in spec.get("steady", []):
        t = time.perf_counter()
        call(b)  # warm-up: loads (or compiles) this shape
        warm_up_s, layer = time.perf_counter() - t, pipe.last.cache_layer
        call(b)  # and one more, untimed, so allocators and caches settle
        times = []
        for _ in range(spec["steady_repeats"]):
            t = time.perf_counter()
            call(b)
            times.append(time.perf_counter() - t)
        steady[str(b)] = {"call_s": times, "warm_up_s": warm_up_s, "warm_up_cache_layer": layer}
    if steady:
        out["steady"] = steady
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["load_average_1m"] = os.getloadavg()[0]  # other jobs on the machine skew every timing
    if not spec["path"].startswith("jax"):
        import torch

        out["torch_threads"] = torch.get_num_threads()
    out["device_peak_mb"] = _device_peak_mb(spec)
    events = pipe.compiler.events if pipe.compiler is not None else None
    if events:
        out["cache_events"] = [{k: v for k, v in e.items() if k in ("mode", "layer", "miss", "quarantined", "store")}
                               for e in events]
    return out


# ---------------------------------------------------------------------------------------------
# The parent


def _run_child(spec: dict[str, Any], home: Path, scratch: Path, extra_env: dict[str, str], timeout: float
               ) -> dict[str, Any]:
    inductor_dir = Path(tempfile.mkdtemp(prefix="inductor-", dir=scratch))
    env = {**os.environ, "PREHEAT_HOME": str(home), "PREHEAT_CACHE": "full",
           "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), **extra_env}
    cmd = [sys.executable, "-m", "preheat.bench.compare", "--child", json.dumps(spec)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"path": spec["path"], "error": f"timed out after {timeout:.0f}s"}
    finally:
        shutil.rmtree(inductor_dir, ignore_errors=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            result["child_wall_s"] = time.perf_counter() - started
            return result
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
    return {"path": spec["path"], "error": f"child failed ({proc.returncode}): {tail[0][:300]}"}


def _summary(values: list[float]) -> dict[str, float] | None:
    from preheat.bench.common import summary

    values = [v for v in values if v is not None]
    return summary(values) if values else None


def _resolve_defaults(model: str | None, sampler: str | None, steps: int | None, guidance: float | None
                      ) -> dict[str, Any]:
    """Sampler / steps / guidance from the model's defaults, read without loading anything."""
    from preheat.engine import BUILTIN_MODEL

    root = BUILTIN_MODEL if model is None else Path(model).expanduser()
    defaults: dict[str, Any] = {}
    index = root / "model_index.json"
    if index.is_file():
        try:
            defaults = json.loads(index.read_text()).get("preheat", {}).get("defaults", {})
        except (OSError, ValueError):
            defaults = {}
    if sampler is None:
        from preheat.samplers import DETERMINISTIC_SAMPLERS

        fallback = "flow_euler" if _flow_scheduler(root) else "ddim"  # flow-matching folders take only flow samplers
        sampler = defaults.get("sampler", fallback)
        if sampler not in DETERMINISTIC_SAMPLERS:
            sampler = fallback  # agreement needs a deterministic sampler
    return {"sampler": sampler, "steps": steps or int(defaults.get("steps", 20)),
            "guidance": guidance if guidance is not None else defaults.get("guidance")}


def bench_compare(model: str | None, *, sampler: str | None = None, steps: int | None = None, batch: int = 8,
                  batch_sizes: tuple[int, ...] = (1, 8, 32), seed: int = 0, guidance: float | None = None,
                  repeats: int = 3, steady_repeats: int = 5, paths: tuple[str, ...] = PATHS,
                  xla_variants: dict[str, str] | None = None, workdir: Path, timeout: float = 1800.0,
                  log: Callable[[str], None] = lambda s: None, inputs: dict[str, Any] | None = None,
                  flags: dict[str, list[str]] | None = None, dtype: str | None = None,
                  config: str | None = None, companions: dict[str, str] | None = None) -> dict[str, Any]:
    """Every path in fresh processes on the same model and inputs: ``inputs`` as ``generate``
    keywords, or ``flags`` as `preheat sample`'s family flags (typed here by the folder's declared
    family, so a bad one is a one-line error before any child starts).

    A single file (``config``: as ``preheat.load`` takes it) is converted here, once, into the
    diffusers folder both backends read (``preheat.file_configs.converted_folder``); every child
    loads that folder, so no path's cold start includes a conversion the others skip. ``companions``:
    second model folders (``controlnet``, ``refiner``) every path loads beside the model. A GGUF file's
    torch paths load the file itself with its config folder (diffusers' GGUF loader, as ``sample
    --backend torch`` does), the JAX paths its converted folder. A file a torch path cannot read
    (scaled fp8, a GGUF type diffusers cannot dequantise) is one line before any child starts."""
    from preheat.bench.random_models import materialize_model
    from preheat.bench.random_models import random_name, sized_inputs

    torch_model: dict[str, str] = {}  # a GGUF file: what the torch paths load instead of ``model``
    name = random_name(model)
    model = materialize_model(model, workdir)
    if model is not None:
        from preheat.store import is_remote, resolve

        if is_remote(model):  # pulled once here; the children (private cache roots) read the snapshot
            model = str(resolve(model))
        from preheat.file_configs import converted_folder, gguf_source, plain_tensors

        torch_paths = any(not p.startswith("jax") for p in paths)
        aot = "aot" if "torch-aot" in paths else "none"  # refused for a GGUF file, before any child starts
        gguf = gguf_source(Path(model), config, None, aot) if torch_paths else None  # types checked, configs pulled
        if gguf is not None:  # a torch path reads the file as diffusers does, beside its config folder
            torch_model = {"model": str(gguf.file), "config": str(gguf.configs)}
            config = str(gguf.configs)  # the JAX path's conversion reads the same folder (nothing pulled twice)
        jax_paths = any(p.startswith("jax") for p in paths) or gguf is None
        converted = converted_folder(model, Path(model), config, None,
                                     check=plain_tensors if torch_paths and gguf is None else None) if jax_paths else None
        if converted is not None:  # a single file: its converted folder, for every path (a GGUF: the JAX paths)
            model = str(converted.root)
        elif gguf is not None:  # torch paths only: the config folder declares the family and defaults
            model = str(gguf.configs)
    companions = {k: str(Path(v).expanduser().resolve()) for k, v in (companions or {}).items()}
    inputs = {**(inputs or {}), **declared_values(model, flags or {}, companions)}
    inputs = sized_inputs(name, inputs)  # a tiny random model runs at its tiny size
    settings = {"model": model or "built-in:digits", "batch": batch, "batch_sizes": list(batch_sizes),
                "seed": seed, "repeats": repeats, "steady_repeats": steady_repeats,
                **_resolve_defaults(model, sampler, steps, guidance)}
    envs: dict[str, dict[str, str]] = {p: {} for p in paths}
    base_flags = os.environ.get("XLA_FLAGS", "")
    for name, flags in (xla_variants or {}).items():
        envs[f"jax[{name}]"] = {"XLA_FLAGS": f"{base_flags} {flags}".strip()}
    names = list(envs)
    prime = [b for b in batch_sizes if b != batch]
    settings["inputs"] = dict(inputs or {})
    settings.update(companions)
    settings["dtype"] = dtype
    common = {"model": model, "dtype": dtype, "sampler": settings["sampler"], "steps": settings["steps"],
              "guidance": settings["guidance"], "seed": seed, "batch": batch, "steady_repeats": steady_repeats,
              "inputs": settings["inputs"], "companions": companions}
    scratch = workdir / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {p: {"empty": [], "warm": []} for p in names}
    homes = {p: workdir / f"home-{p.replace('[', '-').replace(']', '')}" for p in names}

    for i in range(repeats):  # 1. empty cache; the first run of each path then primes its root
        for p in names:
            home = homes[p] if i == 0 else workdir / f"empty-{i}"
            spec = {**common, **_own_model(p, torch_model), "path": p, "prime": prime if i == 0 else []}
            log(f"[{p}] cold start, empty cache ({i + 1}/{repeats})")
            r = _run_child(spec, home, scratch, envs[p], timeout)
            runs[p]["empty"].append(r)
            log(f"[{p}]   {_brief(r)}")
            if i > 0:
                shutil.rmtree(home, ignore_errors=True)
    for i in range(repeats):  # 2. warm cache; 3. steady state + 4. pixels in the first of them
        for p in names:
            spec = {**common, **_own_model(p, torch_model), "path": p}
            if i == 0:
                spec.update(steady=list(batch_sizes), pixels_out=str(workdir / f"pixels-{p}.npy"))
            log(f"[{p}] cold start, warm cache ({i + 1}/{repeats})" + (" + steady state" if i == 0 else ""))
            r = _run_child(spec, homes[p], scratch, envs[p], timeout)
            runs[p]["warm"].append(r)
            log(f"[{p}]   {_brief(r)}")

    result: dict[str, Any] = {"settings": settings, "machine": _machine(), "paths": {}}
    if xla_variants:
        result["xla_variants"] = dict(xla_variants)
    for p in names:
        result["paths"][p] = _summarize(p, runs[p], batch_sizes, workdir, settings)
    result["goals"] = _goals(result)
    return result


def declared_values(folder: str | None, flags: dict[str, list[str]],
                    companions: dict[str, str] | None = None) -> dict[str, Any]:
    """`preheat sample`'s family flags as ``generate`` keywords in a process that reads no weight
    (the bench's parent): typed by the folder's declared family (None: the built-in model's), the
    inputs its ``companions`` (second model folders) add, and the size flags. Bounds that depend on
    the loaded model are the children's calls to check."""
    from preheat.engine import BUILTIN_MODEL
    from preheat.families import declared_family
    from preheat.errors import InvalidArgumentError
    from preheat.families.inputs import size_specs, typed_flags

    if not flags:
        return {}
    root = BUILTIN_MODEL if folder is None else Path(folder)
    family = declared_family(root)
    if family is None:
        raise InvalidArgumentError(f"{folder}'s family declares no inputs: {', '.join(flags)} cannot be given",
                                   argument=next(iter(flags)))
    extra: tuple[Any, ...] = ()
    if companions:  # what a ControlNet or a refiner declares beside the model's own
        from preheat.families.control import CONTROL_SPECS
        from preheat.families.experts import REFINER_SPECS

        extra = ((CONTROL_SPECS if "controlnet" in companions else ())
                 + (REFINER_SPECS if "refiner" in companions else ()))
    return typed_flags((*family.folder_specs(root), *extra, *size_specs(0, 0, 1, 0)), family.name, flags)


def _brief(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    return (f"first image at {r['process_start_to_first_image_s']:.2f}s from process start "
            f"(trace {r['trace_lower_s']:.2f}s, compile {r['compile_s']:.2f}s, cache {r['cache_layer']})")


def _flow_scheduler(root: Path) -> bool:
    """Whether the folder's scheduler is a flow-matching one (FLUX.1, SD3)."""
    try:
        config = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
    except (OSError, ValueError):
        return False
    return str(config.get("_class_name", "")).startswith("FlowMatch")


def _summarize(path: str, runs: dict[str, list[dict[str, Any]]], batch_sizes: tuple[int, ...], workdir: Path,
               settings: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"errors": [r["error"] for rs in runs.values() for r in rs if "error" in r]}
    loads = [r["load_average_1m"] for rs in runs.values() for r in rs if "load_average_1m" in r]
    out["load_average_1m"] = {"min": min(loads), "max": max(loads)} if loads else None
    for state, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        out[state] = {
            "cache_layers": sorted({r["cache_layer"] for r in ok}),
            **{k: _summary([r[k] for r in ok]) for k in ("process_start_to_first_image_s", "first_call_s",
                                                          "load_s", "trace_lower_s", "compile_s", "first_run_s",
                                                          "second_call_s", "peak_rss_mb")},
            "trace_plus_compile_s": _summary([r["trace_lower_s"] + r["compile_s"] for r in ok]),
            "runs": rs,
        }
    steady_child = next((r for r in runs["warm"][:1] if "error" not in r), None)
    steady: dict[str, Any] = {}
    if steady_child:
        for b in batch_sizes:
            s = steady_child.get("steady", {}).get(str(b))
            if s is None:
                continue
            per_image = [c / b for c in s["call_s"]]
            med = _summary(per_image)
            steady[str(b)] = {"per_image_s": med, "images_per_s": 1.0 / med["median"], "call_s": s["call_s"],
                              "warm_up_s": s["warm_up_s"], "warm_up_cache_layer": s["warm_up_cache_layer"]}
        out["peak_rss_mb"] = steady_child.get("peak_rss_mb")
        out["device_peak_mb"] = steady_child.get("device_peak_mb")
    out["steady"] = steady
    out["agreement_vs_torch_eager"] = _agreement(path, workdir, settings)
    return out


def _agreement(path: str, workdir: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    import numpy as np

    from preheat.samplers import DETERMINISTIC_SAMPLERS

    if settings["sampler"] not in DETERMINISTIC_SAMPLERS:
        return None
    mine, ref = workdir / f"pixels-{path}.npy", workdir / "pixels-torch-eager.npy"
    if not (mine.is_file() and ref.is_file()):
        return None
    a, b = np.load(mine).astype(np.int32), np.load(ref).astype(np.int32)
    if a.shape != b.shape:
        return None
    d = np.abs(a - b)
    return {"mean_abs": float(d.mean()), "max_abs": int(d.max()), "mean_abs_01": float(d.mean()) / 255.0,
            "max_abs_01": float(d.max()) / 255.0}


def _goals(result: dict[str, Any]) -> dict[str, Any]:
    paths = result["paths"]
    goals: dict[str, Any] = {}
    aot = paths.get("torch-aot")
    if aot and aot["empty"]["trace_plus_compile_s"] and aot["warm"]["trace_plus_compile_s"]:
        empty, warm = aot["empty"]["trace_plus_compile_s"]["median"], aot["warm"]["trace_plus_compile_s"]["median"]
        goals["torch_aot_compile_share_removed"] = 1 - warm / empty if empty else None
    jax_, ind = paths.get("jax"), paths.get("torch-inductor")
    if jax_ and ind and jax_["steady"] and ind["steady"]:
        common = [b for b in jax_["steady"] if b in ind["steady"]]
        goals["jax_over_torch_compile_images_per_s"] = {
            b: jax_["steady"][b]["images_per_s"] / ind["steady"][b]["images_per_s"] for b in common}
    return goals


def _machine() -> dict[str, Any]:
    from preheat.bench.common import machine_line
    from preheat.env import installed_version

    versions = {dist: installed_version(dist) for dist in ("jax", "jaxlib", "torch", "diffusers", "preheat")}
    gpu = None
    if shutil.which("nvidia-smi"):
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            gpu = None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        usable = os.cpu_count()
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = None
    line = (f"{machine_line()}; torch {versions['torch']}, diffusers {versions['diffusers']}; "
            f"{usable} usable cores; GPU: {gpu or 'none'}")
    if load:
        line += f"; load average {load[0]:.1f} at the end (other jobs share this machine)"
    return {"line": line, "versions": versions, "usable_cores": usable, "gpu": gpu, "load_average": load}


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(s: dict[str, float] | None, scale: float = 1.0, digits: int = 2) -> str:
    if not s:
        return "–"
    from preheat.bench.common import fmt_summary

    return fmt_summary(s, scale=scale, digits=digits)


def markdown(result: dict[str, Any]) -> str:
    from preheat.families.inputs import IMAGE_SIZE

    st = result["settings"]
    sizes = [str(b) for b in st["batch_sizes"]]
    head = (f"**{st['model']}**: {st['sampler']}, {st['steps']} steps, guidance {st['guidance']}, seed {st['seed']}; "
            f"cold starts at batch {st['batch']}, {st['repeats']} fresh processes per cache state; "
            f"steady state {st['steady_repeats']} timed calls per batch. Values: median (min–max).")
    given = IMAGE_SIZE.without(st.get("inputs") or {})
    if given:  # what each call was given beyond the size (an image: its path), so a row says what it measured
        head += " Inputs: " + ", ".join(f"{k}={v}" for k, v in given.items()) + "."
    cols = ["path", "start → 1st image, empty cache s", "… warm cache s", "trace+compile empty s", "… warm s",
            "first call (empty) s", *[f"ms/image b={b}" for b in sizes], f"images/s b={sizes[-1]}",
            "peak RSS MB", "vs eager mean / max |Δpx|"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for p, r in result["paths"].items():
        agree = r.get("agreement_vs_torch_eager")
        steady = r["steady"]
        last = steady.get(sizes[-1])
        cells = [p, _fmt(r["empty"]["process_start_to_first_image_s"]), _fmt(r["warm"]["process_start_to_first_image_s"]),
                 _fmt(r["empty"]["trace_plus_compile_s"]), _fmt(r["warm"]["trace_plus_compile_s"]),
                 _fmt(r["empty"]["first_call_s"]),
                 *[_fmt(steady[b]["per_image_s"], 1000, 1) if b in steady else "–" for b in sizes],
                 f"{last['images_per_s']:.1f}" if last else "–",
                 f"{r['peak_rss_mb']:.0f}" if r.get("peak_rss_mb") else "–",
                 f"{agree['mean_abs']:.3f} / {agree['max_abs']}" if agree else "n/a"]
        lines.append("| " + " | ".join(cells) + " |")
        if r["errors"]:
            lines.append(f"| {p}: {len(r['errors'])} failed run(s): {r['errors'][0][:120]} |")
    layers = ", ".join(f"{p}: {'/'.join(r['empty']['cache_layers'])} → {'/'.join(r['warm']['cache_layers'])}"
                       for p, r in result["paths"].items())
    lines += ["", f"Cache layer at first image (empty → warm): {layers}."]
    g = result.get("goals", {})
    if g.get("torch_aot_compile_share_removed") is not None:
        lines.append(f"Warm cache removes {100 * g['torch_aot_compile_share_removed']:.1f}% of torch-aot's "
                     "trace+compile share of start-up (goal ≥ 90%).")
    if g.get("jax_over_torch_compile_images_per_s"):
        ratios = ", ".join(f"b={b}: {v:.2f}×" for b, v in g["jax_over_torch_compile_images_per_s"].items())
        lines.append(f"JAX images/s over torch.compile's: {ratios} (goal ≥ 1.0×).")
    if result.get("xla_variants"):
        lines.append("XLA_FLAGS variants: " + "; ".join(f"jax[{k}] = `{v}`" for k, v in result["xla_variants"].items()))
    loads = [r["load_average_1m"] for r in result["paths"].values() if r.get("load_average_1m")]
    if loads:
        lines.append(f"1-minute load average seen by the children: {min(v['min'] for v in loads):.1f}–"
                     f"{max(v['max'] for v in loads):.1f} on {result['machine'].get('usable_cores', '?')} usable cores.")
    lines += ["", f"Machine: {result['machine']['line']}"]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(result["paths"])
    sizes = [str(b) for b in result["settings"]["batch_sizes"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    x = np.arange(len(names))
    for k, (state, label) in enumerate((("empty", "empty cache"), ("warm", "warm cache"))):
        s = [result["paths"][n][state]["process_start_to_first_image_s"] for n in names]
        med = [v["median"] if v else 0 for v in s]
        err = [[(v["median"] - v["min"]) if v else 0 for v in s], [(v["max"] - v["median"]) if v else 0 for v in s]]
        ax1.bar(x + (k - 0.5) * 0.38, med, 0.38, yerr=err, capsize=3, label=label)
    ax1.set_xticks(x, names, rotation=20, fontsize=8)
    ax1.set_ylabel("s, process start → first image")
    ax1.set_title("cold start (median, min–max)")
    ax1.legend(fontsize=8)
    width = 0.8 / max(len(sizes), 1)
    for k, b in enumerate(sizes):
        vals = [result["paths"][n]["steady"].get(b) for n in names]
        med = [v["per_image_s"]["median"] * 1000 if v else 0 for v in vals]
        err = [[(v["per_image_s"]["median"] - v["per_image_s"]["min"]) * 1000 if v else 0 for v in vals],
               [(v["per_image_s"]["max"] - v["per_image_s"]["median"]) * 1000 if v else 0 for v in vals]]
        ax2.bar(x + (k - (len(sizes) - 1) / 2) * width, med, width, yerr=err, capsize=2, label=f"batch {b}")
    ax2.set_xticks(x, names, rotation=20, fontsize=8)
    ax2.set_ylabel("ms per image (steady state)")
    ax2.set_title("throughput cost (lower is better)")
    ax2.legend(fontsize=8)
    st = result["settings"]
    fig.suptitle(f"{Path(str(st['model'])).name}: {st['sampler']}, {st['steps']} steps", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


if __name__ == "__main__":  # the child process; the command is `preheat bench compare` (preheat.cli.bench)
    if len(sys.argv) != 3 or sys.argv[1] != "--child":
        sys.exit("usage: python -m preheat.bench.compare --child SPEC_JSON (run `preheat bench compare` instead)")
    print(RESULT_TAG + json.dumps(child_main(json.loads(sys.argv[2])), default=str), flush=True)
