"""One compiled entry per resolution (``dynamic=False``) against
one symbolic-shape entry (``dynamic=True``, duck shapes off), side by side in one run (issue 14).

For each model and setting, three fresh processes, each with a new, empty
``TORCHINDUCTOR_CACHE_DIR`` (a new pod), in this order per model: static cold, dynamic cold,
static warm, dynamic warm, static partial, dynamic partial.

    cold     an empty preheat root; ``preheat.torch.compile(pipe, mode, dynamic)``, then every
             resolution in turn: its first call (compile or not), then steady-state calls
    warm     the cold child's root: the same, as after a restart
    partial  a root holding only what the first resolution stored: a restart that meets a
             resolution it never compiled (static: a compile; dynamic: the one entry serves it)

What a first call costs is its seconds minus the steady-state median at that resolution in the
same child. Frames are Dynamo frames compiled during the call; "fxgraph" are Inductor's FX graph
cache misses (a compile) and hits (a load). Steady state: ``repeats`` calls after one warm-up in
every child, whole pipeline and denoiser alone (its forward, by a hook); the table pools the
three children of a setting (median / min / max), which alternate with the other setting's, so
a machine whose load drifts skews both alike. ``threads``: torch's thread count in the children
(default torch's own); on a small shared machine 1 keeps OpenMP threads from contending.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import click

from preheat.bench.common import fmt_summary, machine_line, summary, write_json
from preheat.bench.random_models import materialize_model
from preheat.cli._support import one_line_errors
from preheat.cli.options import POSITIVE_SECONDS, common_option, echo_result, output_options

__all__ = ["bench_torch_shapes", "child_main", "markdown", "SETTINGS", "MODELS"]

SETTINGS = {"static": False, "dynamic": True}
MODELS = ("random:flux-tiny", "random:sd1-tiny")
RESULT_TAG = "PREHEAT_SHAPES_RESULT "
PROMPT = "a photo of a cat"


# ---------------------------------------------------------------------------------------------
# The child: one fresh process, one setting


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the pipeline, compile it, then each resolution: first call, then steady state."""
    from preheat.timings import process_age_s

    started = time.perf_counter()
    import torch
    from diffusers import DiffusionPipeline
    from torch._dynamo.utils import counters

    import preheat.torch
    from preheat.backends.torch.compiled import DENOISERS
    from preheat.backends.torch.compile_cache import _compile_metrics

    out: dict[str, Any] = {"setting": spec["setting"], "load_average_1m": [os.getloadavg()[0]]}
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    pipe = DiffusionPipeline.from_pretrained(spec["model"])
    pipe.set_progress_bar_config(disable=True)
    out["load_s"] = time.perf_counter() - started
    denoiser_s = [0.0]
    for name in DENOISERS:
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            _time_forward(module, denoiser_s)

    def call(size: int) -> None:
        with torch.no_grad():
            pipe(PROMPT, height=size, width=size, num_inference_steps=spec["steps"], output_type="np",
                 generator=torch.Generator("cpu").manual_seed(0))

    def steady(size: int) -> dict[str, Any]:
        call(size)  # warm-up
        calls, denoiser = [], []
        for _ in range(spec["repeats"]):
            denoiser_s[0] = 0.0
            t = time.perf_counter()
            call(size)
            calls.append(time.perf_counter() - t)
            denoiser.append(denoiser_s[0])
        return {"call_s": summary(calls), "denoiser_s": summary(denoiser), "calls": calls, "denoiser_calls": denoiser}

    if spec.get("eager") and spec["repeats"]:
        out["eager"] = {str(size): steady(size) for size in spec["resolutions"]}
    t = time.perf_counter()
    preheat.torch.compile(pipe, mode=spec["mode"], dynamic=SETTINGS[spec["setting"]])
    out["compile_call_s"] = time.perf_counter() - t
    out["sizes"] = {}
    for size in spec["resolutions"]:
        seen = len(preheat.torch.events(pipe))
        before = _compile_metrics().get("_compile.compile_inner", 0.0)
        counters.clear()
        t = time.perf_counter()
        call(size)
        first = time.perf_counter() - t
        row: dict[str, Any] = {"first_call_s": first,
                               "dynamo_compile_s": _compile_metrics().get("_compile.compile_inner", 0.0) - before,
                               "frames": int(counters["frames"].get("total", 0)),
                               "fxgraph_miss": int(counters["inductor"].get("fxgraph_cache_miss", 0)),
                               "fxgraph_hit": int(counters["inductor"].get("fxgraph_cache_hit", 0))}
        if "start_to_first_image_s" not in out:
            out["start_to_first_image_s"] = process_age_s()
        events = preheat.torch.events(pipe)[seen:]
        row["layers"] = [e.get("layer") for e in events] or ["memory"]  # memory: an earlier entry's code
        row["keys"] = [e["key"] for e in events]
        if spec["repeats"]:
            row.update(steady(size))
        out["sizes"][str(size)] = row
    out["load_average_1m"].append(os.getloadavg()[0])
    out["torch"] = torch.__version__
    out["threads"] = torch.get_num_threads()
    return out


def _time_forward(module: Any, total: list[float]) -> None:
    """Add the seconds of every ``module`` call to ``total[0]`` (hooks run outside its forward)."""
    begun: list[float] = []
    module.register_forward_pre_hook(lambda *_: begun.append(time.perf_counter()))

    def done(*_: Any) -> None:
        total[0] += time.perf_counter() - begun.pop()

    module.register_forward_hook(done)


# ---------------------------------------------------------------------------------------------
# The parent


def _run_child(spec: dict[str, Any], home: Path, workdir: Path, timeout: float) -> dict[str, Any]:
    inductor_dir = Path(tempfile.mkdtemp(prefix="inductor-", dir=workdir))
    env = {**os.environ, "PREHEAT_HOME": str(home), "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    env.pop("PREHEAT_CACHE", None)
    root = str(Path(__file__).resolve().parents[1])  # the child imports benchmarks.shapes from the checkout
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "benchmarks.shapes", "--child", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(inductor_dir, ignore_errors=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
    raise RuntimeError(f"torch-shapes child ({spec['setting']}) failed: {tail[0][:300]}")


def _keep_only(home: Path, keys: list[str]) -> Path:
    """A copy of ``home`` whose torch entries are only ``keys``."""
    kind = home / "compile" / "torch"
    for path in kind.iterdir() if kind.is_dir() else ():
        if path.is_dir() and not path.name.startswith(".") and path.name not in keys:
            shutil.rmtree(path)
    return home


def bench_torch_shapes(models: tuple[str, ...], resolutions: tuple[int, ...], mode: str, steps: int, repeats: int,
                       workdir: Path, timeout: float = 1800.0, threads: int | None = None,
                       log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """For each model (a folder, or random:flux-tiny / random:sd1-tiny), static and dynamic:
    cold, warm and partial children (see the module docstring). Returns per model the children's
    reports and the dynamic / static ratios."""
    result: dict[str, Any] = {"machine": machine_line(), "mode": mode, "steps": steps, "repeats": repeats,
                              "threads": threads, "resolutions": list(resolutions), "models": {}}
    for model in models:
        folder = materialize_model(model, workdir)
        runs: dict[str, dict[str, Any]] = {}
        spec = {"model": folder, "mode": mode, "steps": steps, "repeats": repeats, "threads": threads,
                "resolutions": list(resolutions)}
        name = Path(str(model)).name
        homes = {s: workdir / f"{name}-{s}" for s in SETTINGS}
        for phase in ("cold", "warm", "partial"):
            for setting in SETTINGS:
                home = homes[setting]
                if phase == "partial":
                    first_keys = runs[f"{setting} cold"]["sizes"][str(resolutions[0])]["keys"]
                    home = workdir / f"{name}-{setting}-partial"
                    shutil.copytree(homes[setting], home)
                    _keep_only(home, first_keys)
                log(f"{name}: {setting} {phase} (load {os.getloadavg()[0]:.1f})")
                runs[f"{setting} {phase}"] = _run_child(
                    {**spec, "setting": setting, "eager": phase == "cold" and setting == "static"}, home, workdir,
                    timeout)
        entries = {s: sum(1 for p in (homes[s] / "compile" / "torch").iterdir() if p.is_dir()
                          and not p.name.startswith(".")) for s in SETTINGS}
        result["models"][name] = {"runs": runs, "entries": entries, "table": _table(runs, resolutions)}
    return result


def _extra(runs: dict[str, Any], setting: str, phase: str, size: int) -> float:
    """A first call's seconds above the steady-state median (the same child's) at that size."""
    row = runs[f"{setting} {phase}"]["sizes"][str(size)]
    return row["first_call_s"] - row["call_s"]["median"]


def _pooled(runs: dict[str, Any], setting: str, size: int, what: str) -> dict[str, float]:
    """Steady-state seconds per call at ``size`` over every child of ``setting``."""
    children = [r for name, r in runs.items() if name.startswith(f"{setting} ")]
    return summary([v for r in children for v in r["sizes"][str(size)][what]])


def _table(runs: dict[str, Any], resolutions: tuple[int, ...]) -> list[dict[str, Any]]:
    """Rows of (what, static, dynamic, note); ``ratio``: whether dynamic / static means something."""
    rows: list[dict[str, Any]] = []

    def add(what: str, values: dict[str, Any], note: str = "") -> None:
        rows.append({"what": what, **values, "ratio": True, "note": note})

    def both(phase: str, size: int, field: str) -> str:
        """``field`` of the static and the dynamic child at ``size``, as "static / dynamic"."""
        values = [runs[f"{s} {phase}"]["sizes"][str(size)][field] for s in SETTINGS]
        return " / ".join(",".join(v) if isinstance(v, list) else str(v) for v in values)

    first, rest = resolutions[0], resolutions[1:]
    add(f"cold: first call's compile s at {first}²", {s: _extra(runs, s, "cold", first) for s in SETTINGS})
    for size in rest:
        add(f"cold: extra compile s at {size}²", {s: _extra(runs, s, "cold", size) for s in SETTINGS},
            note="frames " + both("cold", size, "frames"))
    add("cold: frames compiled, all sizes",
        {s: sum(r["frames"] for r in runs[f"{s} cold"]["sizes"].values()) for s in SETTINGS})
    eager = runs["static cold"].get("eager") or {}
    for size in resolutions:
        add(f"steady s / call at {size}² (pipeline)", {s: _pooled(runs, s, size, "calls") for s in SETTINGS})
        add(f"steady s / call at {size}² (denoiser)", {s: _pooled(runs, s, size, "denoiser_calls") for s in SETTINGS},
            note="eager " + fmt_summary(eager[str(size)]["denoiser_s"], digits=3) if eager else "")
    add("warm: process start → first image s", {s: runs[f"{s} warm"]["start_to_first_image_s"] for s in SETTINGS},
        note="cold " + " / ".join(f"{runs[f'{s} cold']['start_to_first_image_s']:.1f}" for s in SETTINGS))
    for size in resolutions:
        add(f"warm: first call's load s at {size}²", {s: _extra(runs, s, "warm", size) for s in SETTINGS},
            note="layers " + both("warm", size, "layers"))
    for size in rest:
        add(f"partial (only {first}² stored): first call s at {size}²",
            {s: _extra(runs, s, "partial", size) for s in SETTINGS},
            note=f"layers {both('partial', size, 'layers')}; fxgraph miss {both('partial', size, 'fxgraph_miss')}")
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return fmt_summary(value, digits=3)
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _median(value: Any) -> float:
    return float(value["median"] if isinstance(value, dict) else value)


def markdown(result: dict[str, Any]) -> str:
    lines = [f"`benchmarks/shapes.py`: mode {result['mode']}, {result['steps']} steps, resolutions "
             f"{', '.join(map(str, result['resolutions']))}, steady state {result['repeats']} calls — "
             f"{result['machine']}"]
    for name, r in result["models"].items():
        loads = [f"{k} {v['load_average_1m'][0]:.1f}→{v['load_average_1m'][1]:.1f}" for k, v in r["runs"].items()]
        entries = r["entries"]
        lines += ["", f"**{name}** (entries stored: static {entries['static']}, dynamic {entries['dynamic']}; "
                      f"load average per child: {', '.join(loads)})", "",
                  "| | static (per-resolution entries) | dynamic (duck shapes off) | dynamic ÷ static | |",
                  "|---|---|---|---|---|"]
        for row in r["table"]:
            s, d = _median(row["static"]), _median(row["dynamic"])
            ratio = f"{d / s:.2f}×" if row["ratio"] and s > 0 else "–"
            cells = [row["what"], _cell(row["static"]), _cell(row["dynamic"]), ratio, row["note"]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@click.command()
@click.argument("models", nargs=-1)
@click.option("--resolutions", default="32,48,64", show_default=True,
              help="Square image sizes, comma-separated, in the order served (the first is stored alone for the "
                   "partial row).")
@click.option("--mode", type=click.Choice(["regional", "full"]), default="regional", show_default=True)
@common_option("steps", default=2, help="Denoising steps.")
@click.option("--repeats", default=5, show_default=True, type=int, help="Steady-state calls per resolution.")
@click.option("--threads", type=int, help="torch threads in the children (default: torch's own).")
@click.option("--timeout", default=1800.0, show_default=True, type=POSITIVE_SECONDS, help="Seconds per child process.")
@output_options()
@one_line_errors
def main(models: tuple[str, ...], resolutions: str, mode: str, steps: int, repeats: int,
         threads: int | None, timeout: float, json_out: Path | None, as_json: bool) -> None:
    """preheat.torch.compile per-resolution entries (dynamic=False) vs one symbolic-shape entry
    (dynamic=True, duck shapes off): compile seconds per resolution, steady state, warm starts,
    in fresh processes. MODELS: folders or random:flux-tiny / random:sd1-tiny (default both)."""
    from preheat.errors import InvalidArgumentError

    try:
        sizes = tuple(int(s) for s in resolutions.split(",") if s.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) <= 0 or len(set(sizes)) != len(sizes):
        raise InvalidArgumentError(f"--resolutions {resolutions!r} must be distinct comma-separated positive ints")
    if repeats < 1 or (threads is not None and threads < 1):
        raise InvalidArgumentError("--repeats and --threads must be >= 1")
    from preheat.bench.random_models import PREFIX, RANDOM_MODELS, random_name
    from preheat.errors import ModelNotFoundError

    for model in models:
        if random_name(model) is None and not (Path(model).expanduser() / "model_index.json").is_file():
            raise ModelNotFoundError(f"{model} is neither a diffusers pipeline folder nor one of "
                                     f"{', '.join(PREFIX + n for n in RANDOM_MODELS)}")
    with tempfile.TemporaryDirectory(prefix="preheat-shapes-") as tmp:
        result = bench_torch_shapes(models or MODELS, sizes, mode, steps, repeats, Path(tmp), timeout,
                                    threads, log=lambda line: click.echo(line, err=True))
    echo_result(result, markdown(result), as_json)
    write_json(json_out, result)


if __name__ == "__main__":  # `--child SPEC_JSON`: one child process of main
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(RESULT_TAG + json.dumps(child_main(json.loads(sys.argv[2])), default=str), flush=True)
    else:
        main()
