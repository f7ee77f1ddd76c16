"""The measurements of scripts/gpu_check.sh (run after its preflight and offline install).

Everything heavy runs in fresh child processes (the parent never imports JAX or torch, so it
holds no GPU memory), each under a deadline taken from one budget for the whole run; a step that
no longer fits is recorded as skipped, never silently dropped. In order, most valuable first:

1. ``preheat doctor --json`` (with ``--require-gpu`` on the GPU: without a GPU backend the rest is
   skipped, since it would measure the CPU).
2. Per model in ``MODELS`` (random weights at the real resolution, in the model's dtype), fresh
   ``preheat sample`` processes, each with its own ``PREHEAT_HOME``:
   ``empty`` (trace + lower + compile; writes the executable), then ``full warm`` (that
   serialized executable loaded back in a fresh process: whether preheat's executable layer works
   on this device at all, its pixels compared with the compiled run's); the steady state in one
   more process (the measured ceilings, bf16 matrix-product rate and device copy bandwidth, then
   images/s and the achieved fraction of that matrix rate: the "two numbers" of the device
   METHOD); ``xla only`` (JAX's persistent cache warm, executable layer off; after a priming run).
3. ``preheat bench compare --quick`` on the built-in model (JAX vs torch eager / torch.compile).
4. Scaling over local devices (issue 16): ``SCALING_MODEL``'s images/s with the batch split over
   1, 2, 4 and 8 devices (as many as are present; ``n`` images per device), and the efficiency
   ``images/s on k / (k x images/s on 1)``; skipped (not failed) with one device. The dry run
   forces two CPU devices, so the code runs before any GPU draw.
5. More fresh processes for the warm rows, while the budget lasts.

Writes under ``--out``: doctor.json, models.json, compare.json, summary.md, log.txt (with the
shell's preflight.json: 6 files); the summary table is printed last. GPU_CHECK_SKIP=models or
=compare (comma-separated) leaves those steps out, for a targeted rerun.

    python scripts/gpu_measure.py run --out DIR --mode gpu|dry [--budget S] [--started-at EPOCH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULT_TAG = "GPU_MEASURE_RESULT "


# ---------------------------------------------------------------------------------------------
# What is measured


@dataclass(frozen=True)
class Model:
    """One model for the cold-start rows and the steady state.

    ``arch`` is a UNet2DModel config (random weights are written here in ``dtype``) or a name in
    ``preheat.bench.common.ARCHITECTURES`` (written by ``random_models.materialize_model``, loaded in ``dtype``).
    ``sample_args`` are more ``preheat sample`` arguments and ``generate_kwargs`` the same for
    ``Pipeline.generate`` in the steady-state child (e.g. a prompt and a size for text-to-image).
    """

    name: str
    arch: dict[str, Any] | str
    n: int
    steps: int
    sampler: str = "ddim"
    dtype: str = "bfloat16"
    sample_args: tuple[str, ...] = ()
    generate_kwargs: dict[str, Any] = field(default_factory=dict)


# google/ddpm-{church,bedroom,cat,celebahq}-256: the largest UNet2DModel family preheat loads
# today (113.7 M parameters; config.json of those checkpoints).
DDPM_256 = dict(
    sample_size=256, in_channels=3, out_channels=3, layers_per_block=2,
    block_out_channels=[128, 128, 256, 256, 512, 512],
    down_block_types=["DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"],
    attention_head_dim=None, norm_eps=1e-6, norm_num_groups=32, act_fn="silu", flip_sin_to_cos=False,
    freq_shift=1, downsample_padding=0, center_input_sample=False, mid_block_scale_factor=1,
    time_embedding_type="positional",
)
# Tiny, for the CPU dry run (one plain and one attention level: compiles in seconds).
DDPM_256_TINY = {**DDPM_256, "sample_size": 16, "layers_per_block": 1, "block_out_channels": [32, 32],
                 "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
                 "up_block_types": ["AttnUpBlock2D", "UpBlock2D"]}

_PROMPT = "a watercolor fox in a forest"
MODELS = [
    # SD 1.5 at its real resolution: the full-size architecture with random weights
    # (preheat.bench.random_models, written by torch + diffusers + transformers), bf16 UNet.
    Model("sd15-512", "sd15-random", n=4, steps=20, sampler="dpmpp_2m",
          sample_args=("--prompt", _PROMPT, "--width", "512", "--height", "512"),
          generate_kwargs={"prompt": _PROMPT, "width": 512, "height": 512}),
    Model("ddpm-256", DDPM_256, n=8, steps=20),
    # SDXL at 1024x1024 needs a random-weight SDXL writer in preheat.bench.random_models first.
]
DRY_MODELS = [Model("ddpm-256-tiny", DDPM_256_TINY, n=2, steps=2)]
SCALING_MODEL = {"gpu": "ddpm-256", "dry": "ddpm-256-tiny"}  # the model measured on 1, 2, 4, 8 devices
SCALING_COUNTS = (1, 2, 4, 8)

# Per mode: seconds a step may take at most / needs at least to be started, and sizes.
GPU = dict(doctor=(90, 20), materialize=(120, 20), empty=(240, 60), warm=(90, 15), xla=(240, 60),
           steady=(150, 30), compare=(240, 90), scaling=(300, 60), warm_repeats=2, matmul_n=8192, copy_mib=2048,
           ceiling_repeats=20, steady_repeats=5,
           compare_args=("--quick", "--paths", "jax,torch-eager,torch-inductor"))
# Dry: the caps only catch a hang (a slow shared CI machine must not turn into a skipped step).
DRY = dict(doctor=(300, 5), materialize=(300, 5), empty=(300, 5), warm=(300, 5), xla=(300, 5),
           steady=(300, 5), compare=(600, 5), scaling=(300, 5), warm_repeats=1, matmul_n=256, copy_mib=8,
           ceiling_repeats=3, steady_repeats=2,
           compare_args=("--quick", "--paths", "jax,torch-eager", "--steps", "1", "--batch-sizes", "1",
                         "--steady-repeats", "1"))
END_RESERVE_S = 10


# ---------------------------------------------------------------------------------------------
# Child processes


@dataclass
class Proc:
    rc: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    def tail(self, n: int = 300) -> str:
        lines = [ln for ln in (self.stderr or self.stdout).strip().splitlines() if ln.strip()]
        return (lines[-1] if lines else f"exit {self.rc}")[:n]

    def result(self) -> dict[str, Any] | None:
        for line in reversed(self.stdout.splitlines()):
            if line.startswith(RESULT_TAG):
                return json.loads(line[len(RESULT_TAG):])
        return None


class Runner:
    """Runs children under one deadline and keeps the log."""

    def __init__(self, out: Path, work: Path, mode: str, deadline: float):
        self.out, self.work, self.mode, self.deadline = out, work, mode, deadline
        self.limits = GPU if mode == "gpu" else DRY
        self.log = (out / "log.txt").open("a")

    def left(self) -> float:
        return self.deadline - time.time() - END_RESERVE_S

    def fits(self, step: str) -> float | None:
        """The timeout for ``step``, or None when its minimum no longer fits the budget."""
        cap, need = self.limits[step]
        left = self.left()
        return None if left < need else min(cap, left)

    def say(self, line: str) -> None:
        stamp = f"[{time.strftime('%H:%M:%S')}] {line}"
        print(stamp, flush=True)
        self.log.write(stamp + "\n")
        self.log.flush()

    def run(self, title: str, cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> Proc:
        self.say(f"{title}: {' '.join(cmd[1:])[:200]} (timeout {timeout:.0f}s)")
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=self.work,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and whatever it started
            out, err = proc.communicate()
            timed_out = True
        seconds = time.perf_counter() - start
        self.log.write(f"--- {title}: exit {proc.returncode}{' (timed out)' if timed_out else ''}, {seconds:.1f}s\n")
        for name, text in (("stdout", out), ("stderr", err)):
            if text.strip():
                self.log.write(f"--- {name}\n{text.rstrip()[-20000:]}\n")
        self.log.flush()
        return Proc(proc.returncode, out, err, seconds, timed_out)


def _fail(p: Proc) -> str | None:
    if p.timed_out:
        return f"timed out after {p.seconds:.0f}s"
    if p.rc != 0:
        return f"exit {p.rc}: {p.tail()}"
    return None


# ---------------------------------------------------------------------------------------------
# 1. doctor


def step_doctor(r: Runner) -> dict[str, Any]:
    timeout = r.fits("doctor")
    if timeout is None:
        return {"skipped": "budget"}
    cmd = [sys.executable, "-m", "preheat", "doctor", "--json"] + (["--require-gpu"] if r.mode == "gpu" else [])
    p = r.run("doctor", cmd, timeout)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = {"error": _fail(p) or "no JSON on stdout", "stdout": p.stdout[-5000:], "stderr": p.stderr[-5000:]}
    (r.out / "doctor.json").write_text(json.dumps(doc, indent=2) + "\n")
    jax_check = next((c for c in doc.get("checks", []) if c.get("id") == "jax"), {})
    return {"seconds": p.seconds, "exit": p.rc, "summary": doc.get("summary"), "gpu_backend": doc.get("gpu_backend"),
            "jax": jax_check.get("finding"), "error": doc.get("error"),
            "not_ok": [f"{c['id']}: {c['status']}: {c['finding']}" for c in doc.get("checks", [])
                       if c.get("status") != "ok"]}


# ---------------------------------------------------------------------------------------------
# 2. models: random weights, cold start rows, steady state


def materialize(arch: dict[str, Any] | str, dtype: str, out: Path) -> dict[str, Any]:
    """(child) A random-weight diffusers folder for ``arch`` under ``out``."""
    import jax
    import numpy as np

    if isinstance(arch, str):
        from preheat.bench.random_models import materialize_model

        path = Path(materialize_model(arch, out))
    else:
        import ml_dtypes
        from flax import nnx

        from preheat.models.loading import save_unet
        from preheat.models.unet2d import UNet2DConfig, UNet2DModule

        config = UNet2DConfig.from_dict(arch)
        model = UNet2DModule(config, rngs=nnx.Rngs(0))
        path = out / "model"
        save_unet(config, nnx.state(model), path / "unet",
                  dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
        scheduler = {"_class_name": "DDPMScheduler", "num_train_timesteps": 1000, "beta_schedule": "linear",
                     "beta_start": 0.0001, "beta_end": 0.02, "clip_sample": True, "variance_type": "fixed_small"}
        (path / "scheduler").mkdir(parents=True, exist_ok=True)
        (path / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
        (path / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline"}))
        del model
    weights = sorted(path.rglob("*.safetensors"))
    from safetensors import safe_open

    params = 0
    for w in weights:
        with safe_open(str(w), "np") as f:
            for k in f.keys():
                params += int(np.prod(f.get_slice(k).get_shape()))
    del jax
    return {"path": str(path), "params": params, "weights_bytes": sum(w.stat().st_size for w in weights)}


def _sample_cmd(m: Model, folder: str, png: Path, report: Path, cache: str) -> list[str]:
    return [sys.executable, "-m", "preheat", "sample", folder, "--n", str(m.n), "--steps", str(m.steps),
            "--sampler", m.sampler, "--dtype", m.dtype, "--seed", "0", "--out", str(png), "--report", str(report),
            "--quiet", "--cache", cache, *m.sample_args]


ROW_KEYS = ("process_start_to_first_image_s", "import_s", "weights_s", "trace_lower_s", "compile_or_load_s",
            "first_run_s", "warm_run_s")


def _summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _pixels_delta(a: Path, b: Path) -> dict[str, Any]:
    import numpy as np
    from PIL import Image

    x = np.asarray(Image.open(a)).astype(np.int32)
    y = np.asarray(Image.open(b)).astype(np.int32)
    if x.shape != y.shape:
        return {"identical": False, "shapes": [list(x.shape), list(y.shape)]}
    d = np.abs(x - y)
    return {"identical": bool((d == 0).all()), "max_abs": int(d.max()), "mean_abs": float(d.mean())}


class ModelRun:
    """Cold-start rows and steady state of one model: ``first`` runs one of each row and the
    steady state; ``repeats`` (after bench compare, if the budget allows) adds fresh processes."""

    def __init__(self, r: Runner, m: Model):
        self.r, self.m = r, m
        self.base = r.work / m.name
        self.homes = {"full": self.base / "home-full", "xla": self.base / "home-xla"}
        self.folder: str | None = None
        self.xla_primed = False
        self.res: dict[str, Any] = {"model": m.name, "n": m.n, "steps": m.steps, "sampler": m.sampler,
                                    "dtype": m.dtype, "arch": m.arch, "rows": {}, "runs": [], "skipped": []}

    def sample(self, row: str | None, step: str, cache: str, tag: str) -> dict[str, Any] | None:
        r, m, res = self.r, self.m, self.res
        timeout = r.fits(step)
        if timeout is None:
            res["skipped"].append(f"{tag}: budget")
            return None
        png, report = self.base / f"{tag}.png", self.base / f"{tag}.json"
        p = r.run(f"{m.name}: {tag}", _sample_cmd(m, str(self.folder), png, report, cache), timeout,
                  env={"PREHEAT_HOME": str(self.homes[cache])})
        err = _fail(p)
        if err or not report.is_file():
            run = {"row": row, "tag": tag, "error": err or "no report"}
        else:
            run = {"row": row, "tag": tag, "png": str(png), "wall_s": p.seconds, **json.loads(report.read_text())}
        res["runs"].append(run)
        r.say(f"{m.name}: {tag}: " + (run.get("error") or
              f"first image at {run['process_start_to_first_image_s']:.1f}s, layer {run['cache_layer']}"))
        self._rows()
        return None if "error" in run else run

    def first(self) -> None:
        r, m, res = self.r, self.m, self.res
        self.base.mkdir(parents=True, exist_ok=True)
        timeout = r.fits("materialize")
        if timeout is None:
            res["skipped"].append("everything: budget")
            return
        spec = json.dumps({"arch": m.arch, "dtype": m.dtype, "out": str(self.base)})
        p = r.run(f"{m.name}: random weights", [sys.executable, str(Path(__file__).resolve()), "materialize", spec],
                  timeout, env={"JAX_PLATFORMS": "cpu"})
        made = p.result()
        if made is None:
            res["error"] = f"random weights: {_fail(p) or 'no result'}"
            return
        res.update(params=made["params"], weights_bytes=made["weights_bytes"], materialize_s=p.seconds)
        self.folder = made["path"]
        empty = self.sample("empty", "empty", "full", "empty")
        warm = self.sample("full warm", "warm", "full", "full-warm-1") if empty else None
        if empty and warm:
            res["executable_roundtrip"] = {"layer": warm.get("cache_layer"), "cache_events": warm.get("cache_events"),
                                           "pixels_vs_compiled_run": _pixels_delta(Path(empty["png"]),
                                                                                   Path(warm["png"]))}
        res["steady"] = step_steady(r, m, self.folder, self.homes["full"])
        self.xla_primed = self.sample(None, "xla", "xla", "xla-prime") is not None
        if self.xla_primed:
            self.sample("xla only", "warm", "xla", "xla-only-1")

    def repeats(self) -> None:
        if self.folder is None:
            return
        for i in range(2, self.r.limits["warm_repeats"] + 1):
            if self.xla_primed:
                self.sample("xla only", "warm", "xla", f"xla-only-{i}")
            self.sample("full warm", "warm", "full", f"full-warm-{i}")

    def _rows(self) -> None:
        for row in ("empty", "xla only", "full warm"):
            ok = [x for x in self.res["runs"] if x["row"] == row and "error" not in x]
            if ok:
                self.res["rows"][row] = {"layers": sorted({x["cache_layer"] for x in ok}),
                                         **{k: _summary([x[k] for x in ok if x.get(k) is not None]) for k in ROW_KEYS}}


def step_steady(r: Runner, m: Model, folder: str, home: Path) -> dict[str, Any]:
    timeout = r.fits("steady")
    if timeout is None:
        return {"skipped": "budget"}
    lim = r.limits
    spec = json.dumps({"folder": folder, "n": m.n, "steps": m.steps, "sampler": m.sampler, "dtype": m.dtype,
                       "generate_kwargs": m.generate_kwargs, "matmul_n": lim["matmul_n"], "copy_mib": lim["copy_mib"],
                       "ceiling_repeats": lim["ceiling_repeats"], "repeats": lim["steady_repeats"]})
    p = r.run(f"{m.name}: steady state", [sys.executable, str(Path(__file__).resolve()), "steady", spec], timeout,
              env={"PREHEAT_HOME": str(home)})
    out = p.result()
    if out is None:
        return {"error": _fail(p) or "no result"}
    out["seconds"] = p.seconds
    r.say(f"{m.name}: steady: {out['images_per_s']:.2f} images/s; matrix rate "
          f"{_pct(out.get('matrix_fraction_of_peak'))} of the measured bf16 peak")
    return out


def step_scaling(r: Runner, m: Model, folder: str, home: Path) -> dict[str, Any]:
    """Images/s of ``m`` split over 1, 2, 4, 8 local devices (those present), in one fresh process."""
    timeout = r.fits("scaling")
    if timeout is None:
        return {"skipped": "budget"}
    spec = json.dumps({"folder": folder, "n_per_device": m.n, "steps": m.steps, "sampler": m.sampler,
                       "dtype": m.dtype, "generate_kwargs": m.generate_kwargs, "counts": list(SCALING_COUNTS),
                       "repeats": r.limits["steady_repeats"]})
    # dry: two CPU devices, so that the measuring code runs (a CPU measures overhead, not speed-up)
    env = {"PREHEAT_HOME": str(home)}
    if r.mode == "dry":
        env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    p = r.run(f"{m.name}: scaling over devices", [sys.executable, str(Path(__file__).resolve()), "scaling", spec],
              timeout, env=env)
    out = p.result()
    if out is None:
        return {"error": _fail(p) or "no result"}
    out["seconds"] = p.seconds
    if "skipped" in out:
        r.say(f"{m.name}: scaling: skipped ({out['skipped']})")
    else:
        r.say(f"{m.name}: scaling: " + ", ".join(f"{k} device(s) {x['images_per_s']:.2f} images/s "
                                                   f"({_pct(x['efficiency'])})" for k, x in out["devices"].items()))
    return out


def scaling_child(spec: dict[str, Any]) -> dict[str, Any]:
    """(child) For each device count k present: load with ``devices=k``, compile, then time
    ``generate(k * n_per_device)``; efficiency = images/s on k / (k x images/s on 1)."""
    import jax

    import preheat

    present = len(jax.devices())
    counts = [k for k in spec["counts"] if k <= present]
    out: dict[str, Any] = {"device_kind": jax.devices()[0].device_kind, "devices_present": present}
    if len(counts) < 2:
        return {**out, "skipped": f"{present} device present" if present == 1 else f"{present} devices present"}
    kw = dict(steps=spec["steps"], sampler=spec["sampler"], **spec["generate_kwargs"])
    rows: dict[str, Any] = {}
    for k in counts:
        pipe = preheat.load(spec["folder"], dtype=spec["dtype"], devices=k, cache="full")
        n = k * spec["n_per_device"]
        pipe.generate(n, seed=0, **kw)  # compile (or load) this mesh's program
        times = []
        for i in range(spec["repeats"]):
            start = time.perf_counter()
            pipe.generate(n, seed=i + 1, **kw)
            times.append(time.perf_counter() - start)
        ips = n / statistics.median(times)
        rows[str(k)] = {"n": n, "call_s": _summary(times), "images_per_s": ips,
                        "efficiency": ips / (k * rows["1"]["images_per_s"]) if rows else 1.0}
        del pipe
    out["devices"] = rows
    return out


def matrix_flops(jaxpr: Any) -> int:
    """FLOPs of the matrix work (dot_general, conv_general_dilated) in a jaxpr, sub-jaxprs included."""
    import math

    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lc)
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            spec = eqn.params["dimension_numbers"].rhs_spec  # (out features, in features / groups, *window)
            window = math.prod(rhs[d] for d in spec[2:])
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * rhs[spec[1]] * window
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += matrix_flops(inner)
    return total


def _ceilings(matmul_n: int, copy_mib: int, repeats: int) -> dict[str, Any]:
    """The measured bf16 matrix-product rate and device copy bandwidth (random data, medians)."""
    import jax
    import jax.numpy as jnp

    def median_s(fn: Any, *args: Any) -> float:
        for _ in range(3):
            jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    k1, k2 = jax.random.split(jax.random.key(1))
    a = jax.random.normal(k1, (matmul_n, matmul_n), jnp.bfloat16)
    b = jax.random.normal(k2, (matmul_n, matmul_n), jnp.bfloat16)
    mm_s = median_s(jax.jit(lambda x, y: x @ y), a, b)
    del a, b
    elems = copy_mib * 2**20 // 2
    x = jax.random.normal(k1, (elems,), jnp.bfloat16)
    cp_s = median_s(jax.jit(lambda v: v + 1), x)  # reads and writes each element once
    del x
    return {"matmul_n": matmul_n, "bf16_matmul_tflops": 2 * matmul_n**3 / mm_s / 1e12,
            "copy_mib": copy_mib, "copy_gbps": 2 * elems * 2 / cp_s / 1e9}


def steady_child(spec: dict[str, Any]) -> dict[str, Any]:
    """(child) The card's ceilings, then the model's steady state with its two numbers."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import preheat

    out: dict[str, Any] = {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
                           "backend": jax.default_backend()}
    pipe = preheat.load(spec["folder"], dtype=spec["dtype"], cache="full")  # first: it configures JAX's cache
    out["ceilings"] = _ceilings(spec["matmul_n"], spec["copy_mib"], spec["ceiling_repeats"])
    kw = dict(steps=spec["steps"], sampler=spec["sampler"], seed=0, **spec["generate_kwargs"])
    n = spec["n"]
    start = time.perf_counter()
    pipe.generate(n, **kw)  # from the executable cache the cold-start rows filled (or compiled)
    out["first_call_s"], out["first_call_layer"] = time.perf_counter() - start, pipe.last.cache_layer
    pipe.generate(n, **kw)
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        pipe.generate(n, **kw)  # uint8 pixels on the host, as a user gets them
        times.append(time.perf_counter() - start)
    call = statistics.median(times)
    sig, prepared = pipe.prepare(n, **kw)
    calls = spec["steps"] * sig.spec.max_model_calls_per_step
    model_batch = 2 * n if sig.guided else n
    out.update(n=n, steps=spec["steps"], sampler=spec["sampler"], guided=sig.guided, model_calls=calls,
               call_s=_summary(times), images_per_s=n / call, per_model_call_s=call / calls)

    # The two numbers per model call: matrix FLOPs over the measured matrix rate, and the fewest
    # bytes (weights read once, input in, prediction out) over the measured copy bandwidth.
    h, w, c = sig.sample_shape  # the request's own (latent) size
    sds = lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype)  # noqa: E731
    cond, uncond = prepared[3], prepared[4]  # the conditioning pytrees the engine passes the denoiser
    model_cond = jax.tree.map(lambda a, b: np.concatenate([a, b]), cond, uncond) if sig.guided else cond
    args = (jax.tree.map(sds, pipe.params), jax.ShapeDtypeStruct((model_batch, h, w, c), jnp.dtype(pipe.dtype)),
            jax.ShapeDtypeStruct((model_batch,), jnp.float32), jax.tree.map(sds, model_cond))
    try:
        flops = matrix_flops(jax.make_jaxpr(pipe.apply)(*args).jaxpr)
    except Exception as exc:  # a bug here must not cost the rest of the run: say so, keep the rest
        out["flops_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        flops = None
    try:  # XLA's own count (unoptimised HLO, lowered for the CPU: the GPU plugin has no pre-compile analysis)
        cost = jax.jit(pipe.apply).trace(*args).lower(lowering_platforms=("cpu",)).cost_analysis() or {}
        out["xla_cost_per_call"] = {k: cost.get(k) for k in ("flops", "bytes accessed")}
    except Exception as exc:
        out["xla_cost_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    weight_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(pipe.params))
    io_bytes = 2 * model_batch * h * w * c * jnp.dtype(pipe.dtype).itemsize
    ceil = out["ceilings"]
    per_call = out["per_model_call_s"]
    floor_flops_s = flops / (ceil["bf16_matmul_tflops"] * 1e12) if flops else None
    floor_bytes_s = (weight_bytes + io_bytes) / (ceil["copy_gbps"] * 1e9)
    out.update(matrix_flops_per_call=flops, min_bytes_per_call=weight_bytes + io_bytes,
               gflop_per_image_per_step=flops * sig.spec.max_model_calls_per_step / n / 1e9 if flops else None,
               achieved_matrix_tflops=flops / per_call / 1e12 if flops else None,
               matrix_fraction_of_peak=floor_flops_s / per_call if floor_flops_s else None,
               floor_flops_s=floor_flops_s, floor_bytes_s=floor_bytes_s,
               bound="arithmetic" if (floor_flops_s or 0) >= floor_bytes_s else "memory",
               gap_over_floor=per_call / max(floor_flops_s or 0, floor_bytes_s))
    stats = jax.devices()[0].memory_stats() or {}
    out["device_peak_mib"] = stats["peak_bytes_in_use"] / 2**20 if "peak_bytes_in_use" in stats else None
    return out


# ---------------------------------------------------------------------------------------------
# 3. bench compare


def step_compare(r: Runner) -> dict[str, Any]:
    timeout = r.fits("compare")
    if timeout is None:
        return {"skipped": "budget"}
    dest = r.out / "compare.json"
    child_timeout = max(30.0, 0.6 * timeout)  # one slow child (torch.compile, empty cache) may take most
    cmd = [sys.executable, "-m", "preheat", "bench", "compare", *r.limits["compare_args"],
           "--timeout", f"{child_timeout:.0f}", "--report", str(dest)]
    p = r.run("bench compare", cmd, timeout)
    if not dest.is_file():
        return {"error": _fail(p) or "no JSON written", "seconds": p.seconds}
    data = json.loads(dest.read_text())
    out: dict[str, Any] = {"seconds": p.seconds, "settings": data.get("settings"), "goals": data.get("goals"),
                           "paths": {}}
    for name, path in data.get("paths", {}).items():
        steady = path.get("steady") or {}
        start = {state: (path[state].get("process_start_to_first_image_s") or {}).get("median")
                 for state in ("empty", "warm")}
        out["paths"][name] = {"images_per_s": {b: s["images_per_s"] for b, s in steady.items()},
                              "errors": path.get("errors"), "empty_start_s": start["empty"],
                              "warm_start_s": start["warm"]}
    return out


# ---------------------------------------------------------------------------------------------
# The table


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _med(s: dict[str, float] | None, digits: int = 1) -> str:
    return "–" if not s else f"{s['median']:.{digits}f}"


def table(results: dict[str, Any]) -> str:
    rows = ["| step | s | result |", "|---|---|---|"]
    pre = results.get("preflight") or {}
    v = pre.get("versions", {})
    rows.append(f"| preflight + offline install | {results.get('setup_s', 0):.0f} | python {pre.get('python', '?')}; "
                + ", ".join(f"{k} {x}" for k, x in v.items() if k in ("jax", "jaxlib", "jax-cuda13-plugin",
                                                                     "jax-cuda12-plugin", "flax", "torch")
                            or "carried" in k) + " |")
    d = results.get("doctor", {})
    if "skipped" in d:
        rows.append(f"| doctor | – | skipped ({d['skipped']}) |")
    else:
        s = d.get("summary") or {}
        bad = "; ".join(d.get("not_ok") or [])
        rows.append(f"| doctor | {d.get('seconds', 0):.0f} | exit {d.get('exit')}: {s.get('ok', '?')} ok, "
                    f"{s.get('warn', '?')} warn, {s.get('fail', '?')} fail; {d.get('jax') or d.get('error')}"
                    + (f" — {bad[:300]}" if bad else "") + " |")
    if results.get("models_skipped"):
        rows.append("| models: cold start, executable round trip, steady state | – | "
                    f"skipped: {results['models_skipped']} |")
    for m in results.get("models", []):
        params = f"{m['params'] / 1e6:.1f} M params, " if m.get("params") else ""
        head = f"{m['model']} ({params}{m['dtype']}, batch {m['n']}, {m['sampler']} {m['steps']} steps)"
        if m.get("error"):
            rows.append(f"| {head} | – | {m['error']} |")
            continue
        for name, row in m["rows"].items():
            rows.append(f"| {head}: {name} | {_med(row['process_start_to_first_image_s'])} | start → first image "
                        f"{_med(row['process_start_to_first_image_s'], 2)} s (import {_med(row['import_s'], 2)}, "
                        f"weights {_med(row['weights_s'], 2)}, trace+lower {_med(row['trace_lower_s'], 2)}, "
                        f"compile/load {_med(row['compile_or_load_s'], 2)}, first run {_med(row['first_run_s'], 3)}); "
                        f"layer {'/'.join(row['layers'])}; n={row['process_start_to_first_image_s']['n']} |")
        for run in m["runs"]:
            if "error" in run:
                rows.append(f"| {head}: {run['tag']} | – | FAILED: {run['error']} |")
        rt = m.get("executable_roundtrip")
        if rt:
            px = rt["pixels_vs_compiled_run"]
            same = "identical" if px.get("identical") else f"differ (max {px.get('max_abs')} levels)"
            rows.append(f"| executable serialized, loaded in a fresh process | – | layer {rt['layer']}"
                        f"{' (OK)' if rt['layer'] == 'aot' else ' (NOT loaded from the executable cache)'}; "
                        f"pixels vs the compiled run: {same} |")
        st = m.get("steady") or {}
        if "images_per_s" in st:
            c = st["ceilings"]
            rows.append(f"| {head}: steady state | {st['seconds']:.0f} | {st['images_per_s']:.2f} images/s "
                        f"({st['per_model_call_s'] * 1e3:.2f} ms per model call, first call layer "
                        f"{st['first_call_layer']}); matrix work {st.get('gflop_per_image_per_step') or 0:.3g} "
                        f"GFLOP/image/step at {st.get('achieved_matrix_tflops') or 0:.3g} TFLOP/s = "
                        f"{_pct(st.get('matrix_fraction_of_peak'))} of the measured bf16 peak "
                        f"{c['bf16_matmul_tflops']:.3g} TFLOP/s; {st['bound']}-bound floor, measured "
                        f"{st['gap_over_floor']:.1f}× it (copy {c['copy_gbps']:.3g} GB/s) |")
        elif st:
            rows.append(f"| {head}: steady state | – | {st.get('error') or 'skipped: ' + str(st.get('skipped'))} |")
        sc = m.get("scaling") or {}
        if "devices" in sc:
            rows.append(f"| {head}: scaling over devices | {sc['seconds']:.0f} | " + "; ".join(
                f"{k} × {sc['device_kind']}: {x['images_per_s']:.2f} images/s (batch {x['n']}, efficiency "
                f"{_pct(x['efficiency'])})" for k, x in sc["devices"].items()) + " |")
        elif sc:
            why = sc.get("error") or f"skipped: {sc.get('skipped')}"
            rows.append(f"| {head}: scaling over devices | – | {why} |")
        for s in m.get("skipped", []):
            rows.append(f"| {head}: {s.split(':')[0]} | – | skipped ({s.split(':', 1)[-1].strip()}) |")
    cmp_ = results.get("compare", {})
    if "paths" in cmp_:
        parts = []
        for name, p in cmp_["paths"].items():
            ips = ", ".join(f"b={b}: {x:.1f}" for b, x in p["images_per_s"].items()) or "–"
            err = f" ({len(p['errors'])} failed)" if p.get("errors") else ""
            parts.append(f"{name} {ips} images/s, warm start {p['warm_start_s'] or 0:.1f} s{err}")
        ratio = (cmp_.get("goals") or {}).get("jax_over_torch_compile_images_per_s")
        if ratio:
            parts.append("JAX / torch.compile " + ", ".join(f"b={b}: {x:.2f}×" for b, x in ratio.items()))
        rows.append(f"| bench compare --quick (built-in model) | {cmp_['seconds']:.0f} | {'; '.join(parts)} |")
    elif cmp_:
        why = cmp_.get("error") or f"skipped: {cmp_.get('skipped')}"
        rows.append(f"| bench compare --quick (built-in model) | – | {why} |")
    skipped = f"; left out: {', '.join(results['skipped_steps'])}" if results.get("skipped_steps") else ""
    rows.append(f"| total | {results.get('total_s', 0):.0f} | mode {results['mode']}; "
                f"budget {results['budget_s']:.0f} s{skipped} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# The run


def _guard(r: Runner, record: dict[str, Any], fn: Any) -> None:
    """Run one step; a bug in this script (not a failing child) is recorded, and the run goes on."""
    try:
        fn()
    except Exception as exc:
        import traceback

        r.log.write(traceback.format_exc())
        record["error"] = f"internal error in gpu_measure.py: {type(exc).__name__}: {str(exc)[:300]}"
        r.say(record["error"])


def run(out: Path, mode: str, budget: float, started_at: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    deadline = started_at + budget
    results: dict[str, Any] = {"mode": mode, "budget_s": budget, "setup_s": time.time() - started_at}
    pre = out / "preflight.json"
    results["preflight"] = json.loads(pre.read_text()) if pre.is_file() else None
    failed = False
    with tempfile.TemporaryDirectory(prefix="preheat-gpu-") as tmp:
        r = Runner(out, Path(tmp), mode, deadline)
        results["doctor"] = step_doctor(r)
        gpu_ok = mode != "gpu" or results["doctor"].get("gpu_backend") is True
        failed |= results["doctor"].get("exit") not in (0, None) or "skipped" in results["doctor"]
        models = MODELS if mode == "gpu" else DRY_MODELS
        results["models"] = []
        skip = {s.strip() for s in os.environ.get("GPU_CHECK_SKIP", "").split(",") if s.strip()}
        results["skipped_steps"] = sorted(skip)
        if skip - {"models", "compare"}:
            r.say(f"GPU_CHECK_SKIP: unknown step(s) {', '.join(sorted(skip - {'models', 'compare'}))}; "
                  "known: models, compare")
        if gpu_ok:
            runs = [ModelRun(r, m) for m in models] if "models" not in skip else []
            for mr in runs:
                _guard(r, mr.res, mr.first)
            results["compare"] = {"skipped": "GPU_CHECK_SKIP"}
            if "compare" not in skip:
                results["compare"] = {}
                _guard(r, results["compare"], lambda: results["compare"].update(step_compare(r)))
            for mr in runs:
                if mr.m.name == SCALING_MODEL[mode] and mr.folder is not None:
                    _guard(r, mr.res, lambda mr=mr: mr.res.update(
                        scaling=step_scaling(r, mr.m, str(mr.folder), mr.homes["full"])))
            for mr in runs:
                _guard(r, mr.res, mr.repeats)
            for mr in runs:
                res = mr.res
                results["models"].append(res)
                failed |= bool(res.get("error") or res["skipped"] or any("error" in x for x in res["runs"])
                               or "images_per_s" not in (res.get("steady") or {})
                               or "error" in (res.get("scaling") or {}))  # one device: skipped, not failed
            failed |= bool(skip) or "paths" not in results["compare"] or any(
                p.get("errors") for p in results["compare"]["paths"].values())
        else:
            r.say("JAX does not compute on a GPU (doctor above): the GPU measurements are skipped")
            results["models_skipped"] = "no GPU backend"
            results["compare"] = {"skipped": "no GPU backend"}
        results["total_s"] = time.time() - started_at
        (out / "models.json").write_text(json.dumps(results["models"], indent=2, default=str) + "\n")
        try:
            text = table(results)
        except Exception as exc:  # the JSON is written; never end without a last word
            failed = True
            text = f"(no table: {type(exc).__name__}: {exc}; see models.json, compare.json, log.txt)"
        (out / "summary.md").write_text(text + "\n")
        r.say(f"done: {'some steps failed or were skipped' if failed else 'all steps ran'}; files in {out}")
        r.log.close()
    print("\n" + text, flush=True)
    return 1 if failed else 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] in ("materialize", "steady", "scaling"):
        spec = json.loads(sys.argv[2])
        if sys.argv[1] == "materialize":
            result = materialize(spec["arch"], spec["dtype"], Path(spec["out"]))
        elif sys.argv[1] == "scaling":
            result = scaling_child(spec)
        else:
            result = steady_child(spec)
        print(RESULT_TAG + json.dumps(result, default=str), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("run",))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mode", choices=("gpu", "dry"), required=True)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole check, setup included")
    ap.add_argument("--started-at", type=float, default=None, help="epoch seconds the check started")
    args = ap.parse_args()
    return run(args.out, args.mode, args.budget, args.started_at or time.time())


if __name__ == "__main__":
    raise SystemExit(main())
