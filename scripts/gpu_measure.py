"""The measurements of scripts/gpu_check.sh (run after its preflight and offline install).

Everything heavy runs in fresh child processes (the parent never imports JAX or torch, so it
holds no GPU memory), each under a deadline taken from one budget for the whole run; a step that
no longer fits is recorded as skipped, with its reason, never silently dropped. The rows, in the
order of issue 29 (the first minutes give the most important ones):

1. ``doctor``: ``preheat doctor --json`` (with ``--require-gpu`` on the GPU: without a GPU
   backend the rest is skipped, since it would measure the CPU).
2. ``target``: the built-in model's serving programs compiled on the CPU builder for XLA's H200
   description (``prepare``, below; carried in ``.gpu-targets``), loaded here: the first call's
   layer (``aot`` = the hit, no trace, no compile), its pixels against an on-device compile, the
   images/s of both executables, and ``preheat warm`` on a copy of the carried root, which
   recompiles each not-autotuned entry autotuned and keeps the faster (both timings recorded).
   Then a tiny random SD 1.x folder (written by diffusers on the builder, carried with its
   entries): the same hit and pixels for a text model's three programs, whose attention and
   convolutions a deviceless compile must leave without cuDNN calls it cannot finish.
3. ``sdxl``: SDXL base 1.0 (random weights, written here by diffusers from the published configs)
   at 1024x1024, 30 steps, CFG, batch 1, bf16: ``preheat bench compare`` of JAX against
   ``torch.compile`` (s/image, start -> first image cold and warm), and the fraction of the
   measured bf16 matrix peak that JAX's s/image means (the UNet's matrix FLOPs counted from its jaxpr).
4. ``flux``: the FLUX.1-dev architecture (12 B parameters, random, bf16) at 1024x1024, 28 steps: the same.
5. ``kontext``: FLUX.1 Kontext [dev] (flux-dev's components) with a 1024x1024 reference image: the same.
6. ``fp8``: after the rows above, on the budget they leave: one scaled-fp8 Linear layer (FLUX.1's
   width, per-channel scales; ``preheat.bench.fp8``) compiled here (autotuned): whether the HLO is
   ONE GEMM kernel reading the fp8 weight, and its time against a bf16 GEMM of the same shape.
7. ``fp8unet``: after row 6, on what is left: SD 1.5's UNet at 512² (then SDXL's at 1024², if it
   fits), batch 1 with CFG, random plain fp8 weights made here (``preheat.bench.fp8_unet``): ms
   per denoising step with the fp8 1x1 convs as GEMMs on the fp8 weight (``PREHEAT_FP8_1X1=gemm``)
   against XLA's convolution on a bf16 copy (``=conv``) and against the same weights in bf16,
   compiled here (autotuned); whether the three agree; the decision (keep the GEMM path iff it
   is faster beyond the noise on both UNets).
8. ``xlaser``, not in the default set (``GPU_CHECK_ROWS=doctor,fp8,fp8unet,xlaser``): whether XLA's
   serialisation bug (an executable loaded from JAX's persistent cache, serialised into preheat's
   entry, fails its first run in a new process; known on XLA:CPU) exists here. Fresh ``preheat
   sample`` processes of the built-in model with preheat's guard off
   (``PREHEAT_XLA_SERIALISE_GUARD=off``): "xla" mode fills JAX's cache, full mode's aot miss is
   served by it and stored, a third process runs that entry; then the guard on, on a copy of the
   xla-warm root (the aot miss compiled fresh: what the guard costs). The decision: add this
   platform to ``XLA_SERIALISE_SAFE_PLATFORMS`` iff the entry runs with the "xla" run's pixels.
9. Older rows, not in the default set (``GPU_CHECK_ROWS=models,compare,scaling``): per model in
   ``MODELS`` the cold-start rows, executable round trip and steady state; ``bench compare --quick``
   on the built-in model; scaling over local devices.

``GPU_CHECK_ROWS`` (comma-separated) picks rows (default on the GPU: doctor,target,sdxl,flux,kontext,fp8,fp8unet;
in the dry run: every row, at tiny sizes); ``GPU_CHECK_SKIP`` leaves rows out. Writes under
``--out``: doctor.json, pod-target.txtpb (the card's own description, GPU mode), rows.json (rows
2-8), models.json, compare.json, summary.md, log.txt (with the shell's preflight.json: 8 files);
the summary table is printed last.

    python scripts/gpu_measure.py run --out DIR --mode gpu|dry [--budget S] [--started-at EPOCH]
    python scripts/gpu_measure.py prepare --out .gpu-targets --mode gpu|dry   (on the CPU builder)
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

ROWS = ("doctor", "target", "sdxl", "flux", "kontext", "fp8", "fp8unet", "xlaser", "models", "compare", "scaling")
DEFAULT_ROWS = {"gpu": ("doctor", "target", "sdxl", "flux", "kontext", "fp8", "fp8unet"), "dry": ROWS}
# Row 6's layer: FLUX.1's hidden width and 4096 image tokens on the GPU; tiny in the dry run
FP8_SIZES = {"gpu": dict(n=3072, tokens=4096, calls=20, rounds=20), "dry": dict(n=256, tokens=64, calls=3, rounds=3)}
# Row 7's UNets, in order (SD 1.5 first: it has the 1x1 attention projections; SDXL's are Linear),
# and per call of the three ways: denoising steps per timed call, timed rounds (preheat.bench.fp8_unet)
FP8_UNETS = ("sd15", "sdxl")
FP8_UNET_SIZES = {"gpu": dict(size="full", steps=10, rounds=10), "dry": dict(size="tiny", steps=2, rounds=3)}


@dataclass(frozen=True)
class TargetSet:
    """Row 2: what ``prepare`` compiles on the CPU builder (``preheat warm --target``) and the
    ``preheat sample`` call on the GPU that must hit it (the built-in model; the call's program
    is one of the warmed signatures: batch ``n`` is a bucket of ``max_batch_size``, steps are data)."""

    target: str
    dtype: str
    max_batch_size: int
    guidance: str  # warm's --guidance: "off,on" (the sample's default guidance 2 is "on") or "off"
    n: int
    steps: int
    sample_args: tuple[str, ...] = ()


TARGET_SETS = {
    # batch buckets 1, 2, 4, 8 x guidance off/on: 8 programs, about 4 MB (measured by prepare)
    "gpu": TargetSet("h200", "bfloat16", 8, "off,on", n=8, steps=20),
    "dry": TargetSet("h200", "bfloat16", 1, "off", n=1, steps=2, sample_args=("--guidance", "1")),
}
TARGETS_DIR_ENV = "GPU_TARGETS_DIR"  # default .gpu-targets, in the repository root


@dataclass(frozen=True)
class TextTargetSet:
    """Row 2's text model: a tiny random SD 1.x folder (``preheat.bench.random_models``, 13 MB,
    written on the builder by diffusers, which the GPU machine lacks) and the entries ``preheat
    warm FOLDER --target`` compiles for it, bf16 (so that its 16- and 32-wide heads are ones
    cuDNN's fused attention takes on a device), one image, guidance off; ``preheat sample``'s call
    on the GPU is that signature: its text encoder, denoising loop and VAE decoder must all hit."""

    folder: str = "sd1"  # under the carried folder
    dtype: str = "bfloat16"
    steps: int = 4
    prompt: str = "a red fox"

    def warm_args(self, folder: Path, target: str) -> list[str]:
        return ["warm", str(folder), "--target", target, "--dtype", self.dtype, "--max-batch-size", "1",
                "--guidance", "off", "--json", "--quiet"]

    def sample_args(self, folder: Path) -> list[str]:
        return [str(folder), "--prompt", self.prompt, "--n", "1", "--steps", str(self.steps), "--guidance", "1",
                "--dtype", self.dtype]


TEXT_TARGET = TextTargetSet()


@dataclass(frozen=True)
class HeadToHead:
    """Rows 3-5: a random-weight folder (``random:NAME``, written by diffusers in a child) and
    ``preheat bench compare`` of JAX against torch.compile on it, with ``args``."""

    row: str
    title: str
    model: str  # random:NAME
    args: tuple[str, ...]
    image: int | None = None  # a reference image of this size (Kontext), written here
    count_flops: bool = False  # also the fraction of the measured bf16 matrix peak (JAX's s/image)


_H2H_COMMON = ("--n", "1", "--batch-sizes", "1", "--repeats", "1", "--steady-repeats", "3", "--dtype", "bfloat16",
               "--paths", "jax,torch-inductor", "--prompt", _PROMPT)
HEAD_TO_HEAD = {
    "gpu": [
        HeadToHead("sdxl", "SDXL 1024², 30 steps, CFG 5, batch 1, bf16", "random:sdxl",
                   ("--width", "1024", "--height", "1024", "--steps", "30", "--guidance", "5", *_H2H_COMMON),
                   count_flops=True),
        HeadToHead("flux", "FLUX.1-dev 1024², 28 steps, bf16", "random:flux-dev",
                   ("--width", "1024", "--height", "1024", "--steps", "28", *_H2H_COMMON), count_flops=True),
        HeadToHead("kontext", "FLUX.1 Kontext [dev] 1024² (1024² reference), 28 steps, bf16", "random:kontext-dev",
                   ("--width", "1024", "--height", "1024", "--steps", "28", "--image-resize", "none", *_H2H_COMMON),
                   image=1024),
    ],
    # the dry run: the test suite's tiny folders of the same pipelines, torch eager for torch.compile
    "dry": [
        HeadToHead("sdxl", "SDXL (tiny) 32², 2 steps, CFG 5", "random:sdxl-tiny",
                   ("--width", "32", "--height", "32", "--steps", "2", "--guidance", "5", *_H2H_COMMON[:-4],
                    "--paths", "jax,torch-eager", "--prompt", _PROMPT), count_flops=True),
        HeadToHead("flux", "FLUX.1 (tiny) 32², 2 steps", "random:flux-tiny",
                   ("--width", "32", "--height", "32", "--steps", "2", *_H2H_COMMON[:-4], "--paths",
                    "jax,torch-eager", "--prompt", _PROMPT), count_flops=True),
        HeadToHead("kontext", "FLUX.1 Kontext (tiny) 32² (32² reference), 2 steps", "random:kontext-tiny",
                   ("--width", "32", "--height", "32", "--steps", "2", "--image-resize", "none", *_H2H_COMMON[:-4],
                    "--paths", "jax,torch-eager", "--prompt", _PROMPT), image=32),
    ],
}

# Per mode: seconds a step may take at most / needs at least to be started, and sizes.
# Row 2: t_sample/t_steady/t_retune; rows 3-5: h2h_weights (random weights) and h2h (bench compare).
# The minimum for h2h is what a cold and a warm start of each path need at that size (a guess
# before any run, see docs/gpu.md): SDXL ~4 min, FLUX.1-dev ~6.5 with its weights; a row that
# cannot start with it is skipped, saying so. FLUX.1-dev therefore fits only a call of its own
# (GPU_CHECK_ROWS=doctor,flux), Kontext likewise.
GPU = dict(doctor=(90, 20), t_sample=(120, 20), t_steady=(90, 15), t_retune=(150, 30),
           h2h_weights={"sdxl": (150, 40), "flux": (240, 90), "kontext": (240, 90)},
           h2h={"sdxl": (330, 200), "flux": (450, 300), "kontext": (450, 300)}, flops=(150, 30), fp8=(120, 30),
           fp8unet={"sd15": (180, 75), "sdxl": (270, 150)}, xlaser=(120, 20),
           materialize=(120, 20), empty=(240, 60), warm=(90, 15), xla=(240, 60),
           steady=(150, 30), compare=(240, 90), scaling=(300, 60), warm_repeats=2, matmul_n=8192, copy_mib=2048,
           ceiling_repeats=20, steady_repeats=5,
           compare_args=("--quick", "--paths", "jax,torch-eager,torch-inductor"))
# Dry: the caps only catch a hang (a slow shared CI machine must not turn into a skipped step).
DRY = dict(doctor=(300, 5), t_sample=(300, 5), t_steady=(300, 5), t_retune=(300, 5),
           h2h_weights={"sdxl": (300, 5), "flux": (300, 5), "kontext": (300, 5)},
           h2h={"sdxl": (600, 5), "flux": (600, 5), "kontext": (600, 5)}, flops=(300, 5), fp8=(300, 5),
           fp8unet={"sd15": (300, 5), "sdxl": (300, 5)}, xlaser=(300, 5),
           materialize=(300, 5), empty=(300, 5), warm=(300, 5), xla=(300, 5),
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

    def fits(self, step: str, row: str | None = None) -> float | None:
        """The timeout for ``step`` (``row``'s, where the step's limits are per row), or None when
        its minimum no longer fits the budget."""
        cap, need = self.limits[step] if row is None else self.limits[step][row]
        left = self.left()
        return None if left < need else min(cap, left)

    def needs(self, step: str, row: str | None = None) -> float:
        return (self.limits[step] if row is None else self.limits[step][row])[1]

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
    row = {"seconds": p.seconds, "exit": p.rc, "summary": doc.get("summary"), "gpu_backend": doc.get("gpu_backend"),
           "jax": jax_check.get("finding"), "error": doc.get("error"),
           "not_ok": [f"{c['id']}: {c['status']}: {c['finding']}" for c in doc.get("checks", [])
                      if c.get("status") != "ok"]}
    if r.mode == "gpu" and doc.get("gpu_backend"):
        row["pod_target"] = _pod_target(r)
    return row


def _pod_target(r: Runner) -> dict[str, Any]:
    """The card's own description (``doctor --save-target``, into $OUT), and every numeric field of
    it that differs from XLA's published H200 file: what a builder compiling for this card with
    ``--target h200`` assumes wrongly (the key's fields, and the ones left out of it)."""
    timeout = r.fits("doctor")
    if timeout is None:
        return {"skipped": "budget"}
    path = r.out / "pod-target.txtpb"
    p = r.run("doctor: this card's description", [sys.executable, "-m", "preheat", "doctor", "--save-target",
                                                  str(path)], timeout)
    if p.rc != 0 or not path.is_file():
        return {"error": _fail(p) or "no file"}
    from preheat.cache.targets import resolve_target
    from preheat.platforms import gpu_fields, parse_description

    shipped, card = resolve_target("h200"), path.read_text()

    def info(text: str) -> dict[str, Any]:
        msg = parse_description(text)["gpu_device_info"][0]
        return {k: v[0] for k, v in msg.items() if not isinstance(v[0], dict)}

    a, b = info(shipped.text), info(card)
    return {"file": path.name, "key_fields_equal": gpu_fields(card) == shipped.gpu,
            "differs": {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}}


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


def _jaxpr_with_xla_attention(fn: Any, args: tuple) -> Any:
    """``fn``'s jaxpr traced as for a CPU: attention as XLA's matrix products, which
    ``matrix_flops`` counts (on a GPU the trace would hold cuDNN's fused attention, one opaque
    call); the arithmetic is the same."""
    import jax

    from preheat.platforms import compiling_for

    with compiling_for("cpu", None):
        return jax.make_jaxpr(fn)(*args).jaxpr


def matrix_flops(jaxpr: Any) -> int:
    """FLOPs of the matrix work (dot_general, conv_general_dilated) in a jaxpr, sub-jaxprs included."""
    import math

    from preheat.bench.common import equations

    total = 0
    for eqn in equations(jaxpr):
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
        flops = matrix_flops(_jaxpr_with_xla_attention(pipe.apply, args))
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
# Row 2: executables compiled on the CPU builder for the H200, loaded here


def prepare(out: Path, mode: str) -> int:
    """(on the CPU builder) ``preheat warm --target`` of ``TARGET_SETS[mode]`` into ``out/home``,
    with preheat from this tree (the wheel the GPU installs is built from the same files, so the
    traced sources' hash in the key agrees); ``out/prepare.json`` says what was compiled, how
    long it took and how many bytes travel."""
    import shutil

    ts = TARGET_SETS[mode]
    repo = Path(__file__).resolve().parents[1]
    shutil.rmtree(out, ignore_errors=True)
    home = out / "home"
    home.mkdir(parents=True)
    # this tree's preheat first, then the caller's PYTHONPATH (gpu_wheels.sh puts the pod's cuDNN there)
    path = os.pathsep.join(p for p in (str(repo / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PREHEAT_HOME": str(home), "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}
    env.pop("PREHEAT_CACHE_URL", None)  # these entries travel in the tree, not through a store
    cmd = [sys.executable, "-m", "preheat", "warm", "--target", ts.target, "--dtype", ts.dtype, "--max-batch-size",
           str(ts.max_batch_size), "--guidance", ts.guidance, "--json", "--quiet"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=repo)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
        print(f"gpu_measure prepare: `preheat warm --target {ts.target}` failed (exit {proc.returncode})",
              file=sys.stderr)
        return 2
    entries = sorted((home / "compile" / "jax").glob("*/manifest.json"))
    manifests = [json.loads(m.read_text()) for m in entries]
    text = _prepare_text(out, home, ts.target, env, repo)
    if "error" in text:
        print(text["error"], file=sys.stderr)
        return 2
    files = [f for f in out.rglob("*") if f.is_file()]
    info = {"mode": mode, "set": ts.__dict__, "command": " ".join(cmd[1:]), "seconds": seconds,
            "warm": json.loads(proc.stdout), "entries": len(manifests),
            "executable_bytes": sum(m["files"]["executable.bin"]["size"] for m in manifests),
            "bytes": sum(f.stat().st_size for f in files), "targets": sorted({m["target"]["name"] for m in manifests}),
            "autotuned": sorted({m["autotuned"] for m in manifests}), "cuda": manifests[0]["fields"]["cuda"],
            "text": text}
    (out / "prepare.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"gpu_measure prepare: {len(manifests)} entries for {ts.target} in {seconds:.0f} s; {out} holds "
          f"{info['bytes'] / 2**20:.2f} MiB (executables {info['executable_bytes'] / 2**20:.2f} MiB)")
    return 0


def _prepare_text(out: Path, home: Path, target: str, env: dict[str, str], repo: Path) -> dict[str, Any]:
    """(on the builder) ``TEXT_TARGET``'s folder in ``out`` and its ``warm --target`` entries in
    ``home`` beside the built-in model's: what was compiled, and any entry a GPU would not run."""
    from preheat.bench.random_models import save_random_sd1_tiny  # diffusers writes it: the builder has it
    from preheat.cache.entries import unrunnable

    before = {m.parent.name for m in (home / "compile" / "jax").glob("*/manifest.json")}
    folder = save_random_sd1_tiny(out / TEXT_TARGET.folder)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "preheat", *TEXT_TARGET.warm_args(folder, target)],
                          capture_output=True, text=True, env=env, cwd=repo)
    if proc.returncode != 0:
        return {"error": f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}\ngpu_measure prepare: `preheat warm "
                         f"{TEXT_TARGET.folder} --target {target}` failed (exit {proc.returncode})"}
    made = [json.loads(m.read_text()) for m in sorted((home / "compile" / "jax").glob("*/manifest.json"))
            if m.parent.name not in before]
    return {"folder": TEXT_TARGET.folder, "seconds": time.perf_counter() - start, "entries": len(made),
            "stages": sorted(m["fields"]["signature"].get("stage", "denoise") for m in made),
            "unrunnable": [reason for m in made if (reason := unrunnable(m))]}


def images_child(spec: dict[str, Any]) -> dict[str, Any]:
    """(child) The built-in model from this process's cache root: the first call's layer, then
    images/s of ``generate`` (uint8 pixels on the host, median of ``repeats``)."""
    import preheat

    pipe = preheat.load(None, dtype=spec["dtype"], cache="full")
    kw = dict(steps=spec["steps"], seed=0, **spec["kwargs"])
    start = time.perf_counter()
    pipe.generate(spec["n"], **kw)
    first_s, layer = time.perf_counter() - start, pipe.last.cache_layer
    pipe.generate(spec["n"], **kw)
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        pipe.generate(spec["n"], **kw)
        times.append(time.perf_counter() - start)
    return {"first_call_s": first_s, "first_call_layer": layer, "call_s": _summary(times),
            "images_per_s": spec["n"] / statistics.median(times)}


def _manifests(home: Path) -> list[dict[str, Any]]:
    return [json.loads(m.read_text()) for m in sorted((home / "compile" / "jax").glob("*/manifest.json"))]


def step_target(r: Runner, carried: Path) -> dict[str, Any]:
    """Row 2 (see the module docstring). Each part runs on its own copy of the carried root, so
    none sees what another wrote; the parts that no longer fit the budget are named."""
    import shutil

    if not (carried / "prepare.json").is_file():
        return {"skipped": f"no prepared entries in {carried}: run `python scripts/gpu_measure.py prepare` here "
                           "before the call and carry the folder (docs/gpu.md)"}
    out: dict[str, Any] = {"mode": r.mode, "prepared": json.loads((carried / "prepare.json").read_text()),
                           "skipped": []}
    # the call that must hit: the set prepare compiled (whatever mode prepared it)
    ts = TargetSet(**{k: tuple(v) if k == "sample_args" else v for k, v in out["prepared"]["set"].items()})
    base = r.work / "target"
    base.mkdir()

    def home(name: str, copy: bool) -> Path:
        path = base / name
        if copy:
            shutil.copytree(carried / "home", path)
        else:
            path.mkdir()
        return path

    def sample(tag: str, cache_home: Path, call: list[str] | None = None) -> dict[str, Any] | None:
        """``preheat sample`` on ``cache_home``: the built-in model's call, or ``call``'s."""
        timeout = r.fits("t_sample")
        if timeout is None:
            out["skipped"].append(f"{tag}: budget")
            return None
        png, report = base / f"{tag}.png", base / f"{tag}.json"
        call = call or ["--n", str(ts.n), "--steps", str(ts.steps), "--dtype", ts.dtype, *ts.sample_args]
        cmd = [sys.executable, "-m", "preheat", "sample", *call, "--seed", "0", "--out", str(png), "--report",
               str(report), "--quiet", "--cache", "full"]
        p = r.run(f"target: {tag}", cmd, timeout, env={"PREHEAT_HOME": str(cache_home)})
        err = _fail(p)
        if err or not report.is_file():
            return {"error": err or "no report"}
        rep = json.loads(report.read_text())
        events = [{k: v for k, v in e.items() if k in ("stage", "layer", "miss", "quarantined", "store", "early")}
                  for e in rep.get("cache_events", [])]
        row = {"layer": rep.get("cache_layer"), "png": str(png), "cache_events": events,
               **{k: rep.get(k) for k in ROW_KEYS}}
        r.say(f"target: {tag}: layer {row['layer']}, first image at {row['process_start_to_first_image_s']:.1f}s")
        return row

    carried_home = home("carried", copy=True)
    out["carried"] = sample("carried", carried_home)  # the hit: layer aot, no trace, no compile
    device_home = home("device", copy=False)
    out["device_compile"] = sample("device-compile", device_home)  # the same call compiled here (autotuned)
    a, b = out["carried"], out["device_compile"]
    if a and b and "error" not in a and "error" not in b:
        out["pixels_vs_device_compile"] = _pixels_delta(Path(a["png"]), Path(b["png"]))
    text = out["prepared"].get("text")
    if text and (carried / text["folder"]).is_dir():  # a text model's programs: attention, three stages
        call = TEXT_TARGET.sample_args(carried / text["folder"])
        out["text"] = {"carried": sample("text-carried", home("text-carried", copy=True), call),
                       "device_compile": sample("text-device-compile", home("text-device", copy=False), call)}
        a, b = out["text"]["carried"], out["text"]["device_compile"]
        if a and b and "error" not in a and "error" not in b:
            out["text"]["pixels_vs_device_compile"] = _pixels_delta(Path(a["png"]), Path(b["png"]))

    kwargs: dict[str, Any] = {}
    if ts.sample_args[:1] == ("--guidance",):
        kwargs["guidance"] = float(ts.sample_args[1])
    out["images_per_s"] = {}
    for tag, cache_home in (("carried", carried_home), ("device", device_home)):
        timeout = r.fits("t_steady")
        if timeout is None:
            out["skipped"].append(f"images/s {tag}: budget")
            continue
        spec = json.dumps({"dtype": ts.dtype, "n": ts.n, "steps": ts.steps, "kwargs": kwargs,
                           "repeats": r.limits["steady_repeats"]})
        p = r.run(f"target: images/s ({tag})", [sys.executable, str(Path(__file__).resolve()), "images", spec],
                  timeout, env={"PREHEAT_HOME": str(cache_home)})
        out["images_per_s"][tag] = p.result() or {"error": _fail(p) or "no result"}

    # autotune-and-replace: `preheat warm` on the pod over a fresh copy of the carried entries
    timeout = r.fits("t_retune")
    if timeout is None:
        out["skipped"].append("retune: budget")
    else:
        retune_home = home("retune", copy=True)
        # the set's guided programs only (or its only ones): each costs an autotuned compile here
        cmd = [sys.executable, "-m", "preheat", "warm", "--dtype", ts.dtype, "--max-batch-size",
               str(ts.max_batch_size), "--guidance", ts.guidance.split(",")[-1], "--no-progress", "--json", "--quiet"]
        p = r.run("target: preheat warm (autotune and replace)", cmd, timeout, env={"PREHEAT_HOME": str(retune_home)})
        err = _fail(p)
        try:
            warm = json.loads(p.stdout)
        except ValueError:
            warm = None
        out["retune"] = {"seconds": p.seconds, "error": err if warm is None else None,
                         "signatures": (warm or {}).get("signatures"),
                         "entries": [{"key": m["key"][:12], "target": (m.get("target") or {}).get("name")
                                      if isinstance(m.get("target"), dict) else m.get("target"),
                                      "autotuned": m.get("autotuned"), "retune": m.get("retune")}
                                     for m in _manifests(retune_home)]}
    return out


# ---------------------------------------------------------------------------------------------
# Row 6: the scaled-fp8 Linear layer


def fp8_child(spec: dict[str, Any]) -> dict[str, Any]:
    """(child) ``preheat.bench.fp8.measure`` on this machine's devices."""
    from preheat.bench.fp8 import measure

    return measure(**spec)


def step_fp8(r: Runner) -> dict[str, Any]:
    """Row 6: the child, under the row's cap; skipped (saying why) when its minimum does not fit."""
    timeout = r.fits("fp8")
    if timeout is None:
        return {"skipped": f"budget: needs at least {r.needs('fp8'):.0f} s, {max(0.0, r.left()):.0f} s left"}
    spec = FP8_SIZES[r.mode]
    p = r.run("fp8: scaled-fp8 Linear vs bf16 GEMM", [sys.executable, str(Path(__file__).resolve()), "fp8",
                                                       json.dumps(spec)], timeout)
    got = p.result()
    if got is None:
        return {"error": _fail(p) or "no result", "seconds": p.seconds}
    return {**got, "seconds": p.seconds}


# ---------------------------------------------------------------------------------------------
# Row 7: a whole fp8 UNet step, the 1x1 convs as GEMMs on the fp8 weight or as convolutions


def fp8unet_child(spec: dict[str, Any]) -> dict[str, Any]:
    """(child) ``preheat.bench.fp8_unet.measure_unet`` on this machine's devices."""
    from preheat.bench.fp8_unet import measure_unet

    return measure_unet(**spec)


def fp8unet_decision(res: dict[str, Any]) -> str:
    """docs/gpu.md's rule: keep the GEMM path iff it is faster than the convolution beyond the
    noise (every round) on both UNets and the outputs agree; revert when a UNet says otherwise;
    undecided while a UNet has no measurement."""
    got = {m: res.get(m) or {} for m in FP8_UNETS}
    if any("agreement" in g and not g["agreement"]["ok"] for g in got.values()):
        return "revert: an fp8 way is further from float32 than the bf16 control allows (a bug in that path)"
    measured = {m: g["verdict"] for m, g in got.items() if "verdict" in g}
    if any(v != "faster" for v in measured.values()):
        return "revert: " + ", ".join(f"{m} {v}" for m, v in measured.items())
    if len(measured) < len(FP8_UNETS):
        missing = ", ".join(m for m in FP8_UNETS if m not in measured)
        return f"undecided: no measurement of {missing} (GPU_CHECK_ROWS=doctor,fp8unet)"
    return "keep: faster beyond the noise on " + ", ".join(measured)


def step_fp8unet(r: Runner) -> dict[str, Any]:
    """Row 7: one child per UNet (SD 1.5, then SDXL), each under its cap; a UNet whose minimum no
    longer fits is skipped, saying what it needs; then the decision."""
    out: dict[str, Any] = {}
    skipped, failed = [], []
    for model in FP8_UNETS:
        timeout = r.fits("fp8unet", model)
        if timeout is None:
            out[model] = {"skipped": f"budget: needs at least {r.needs('fp8unet', model):.0f} s, "
                                     f"{max(0.0, r.left()):.0f} s left"}
            skipped.append(model)
            continue
        spec = {"model": model, **FP8_UNET_SIZES[r.mode]}
        p = r.run(f"fp8unet: {model}, 1x1 convs as GEMMs on fp8 vs convolutions vs bf16",
                  [sys.executable, str(Path(__file__).resolve()), "fp8unet", json.dumps(spec)], timeout)
        got = p.result()
        if got is None:
            out[model] = {"error": _fail(p) or "no result", "seconds": p.seconds}
            failed.append(model)
            continue
        out[model] = {**got, "seconds": p.seconds}
        w = got["ways"]
        r.say(f"fp8unet: {model}: ms/step gemm {w['gemm']['ms_per_step']['median']:.3f}, conv "
              f"{w['conv']['ms_per_step']['median']:.3f}, bf16 {w['bf16']['ms_per_step']['median']:.3f}; "
              f"{got['verdict']}; agree {got['agreement']['ok']}")
    out["decision"] = fp8unet_decision(out)
    if skipped:
        out["skipped"] = ", ".join(f"{m}: {out[m]['skipped']}" for m in skipped)
    if failed:
        out["error"] = "; ".join(f"{m}: {out[m]['error']}" for m in failed)
    return out


# ---------------------------------------------------------------------------------------------
# Row 8: does XLA's serialisation bug (an executable loaded from JAX's cache, serialised, fails in
# a new process) exist on this platform? preheat's guard lifted for the row's processes.

XLASER_CALL = ("--n", "2", "--steps", "3", "--seed", "0")  # the built-in model, as docs/benchmarks.md timed it
XLASER_PLATFORM = {"gpu": "gpu", "dry": "cpu"}  # the key's platform each mode tests


def _xlaser_events(rep: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k in ("stage", "layer", "miss", "quarantined", "store", "early")}
            for e in rep.get("cache_events", [])]


def step_xlaser(r: Runner) -> dict[str, Any]:
    """Row 8: fresh ``preheat sample`` processes of the built-in model. Guard off
    (``PREHEAT_XLA_SERIALISE_GUARD=off``) on one fresh root: ``fill`` ("xla" mode: JAX's cache
    only), ``miss`` (full mode: an aot miss served by that cache, serialised into the entry),
    ``hit`` (full mode: that entry, its first run in a new process). Then guard on, on a copy of
    the root as ``fill`` left it: ``miss`` (compiled fresh: the time the guard costs) and ``hit``."""
    import shutil

    need = r.limits["xlaser"][1]
    if r.left() < 3 * need:  # the three guard-off processes answer the question; the rest times it
        return {"skipped": f"budget: needs at least {3 * need:.0f} s, {max(0.0, r.left()):.0f} s left"}
    base = r.work / "xlaser"
    homes = {"off": base / "home-off", "on": base / "home-on"}
    homes["off"].mkdir(parents=True)
    out: dict[str, Any] = {"platform": XLASER_PLATFORM[r.mode], "off": {}, "on": {}, "skipped": []}

    def sample(guard: str, tag: str, cache: str) -> None:
        timeout = r.fits("xlaser")
        if timeout is None:
            out["skipped"].append(f"guard {guard} {tag}: budget")
            return
        png, report = base / f"{guard}-{tag}.png", base / f"{guard}-{tag}.json"
        cmd = [sys.executable, "-m", "preheat", "sample", *XLASER_CALL, "--out", str(png), "--report", str(report),
               "--quiet", "--cache", cache]
        p = r.run(f"xlaser: guard {guard}, {tag} ({cache})", cmd, timeout,
                  env={"PREHEAT_HOME": str(homes[guard]), "PREHEAT_XLA_SERIALISE_GUARD": guard})
        err = _fail(p)
        if err or not report.is_file():
            out[guard][tag] = {"error": err or "no report"}
            return
        rep = json.loads(report.read_text())
        out[guard][tag] = {"layer": rep.get("cache_layer"), "compile_or_load_s": rep.get("compile_or_load_s"),
                           "png": str(png), "cache_events": _xlaser_events(rep)}
        r.say(f"xlaser: guard {guard}, {tag}: layer {rep.get('cache_layer')}, compile/load "
              f"{rep.get('compile_or_load_s') or 0:.2f} s")

    sample("off", "fill", "xla")
    if "png" in out["off"].get("fill", {}):
        shutil.copytree(homes["off"], homes["on"])  # an xla-mode root, for the guard-on miss below
        for guard in ("off", "on"):
            for tag in ("miss", "hit"):
                sample(guard, tag, "full")
    fill = Path(out["off"].get("fill", {}).get("png", "-"))
    for guard in ("off", "on"):
        hit = out[guard].get("hit") or {}
        if "png" in hit:
            hit["pixels_vs_fill"] = _pixels_delta(fill, Path(hit["png"]))
    out["verdict"] = xlaser_verdict(out)
    if not out["skipped"]:
        del out["skipped"]
    return out


def xlaser_verdict(res: dict[str, Any]) -> str:
    """docs/gpu.md's rule for row 8 (written before any run): with the guard off, the entry that
    JAX's cache served and preheat serialised must run its first time in a new process, with the
    pixels of the "xla" run. It runs and matches -> ``add`` this platform to
    XLA_SERIALISE_SAFE_PLATFORMS; it fails or differs -> ``keep`` it out; the miss not served by JAX's
    cache (nothing tested) or a process missing -> ``undecided``."""
    platform, off = res.get("platform", "?"), res.get("off") or {}
    miss, hit = off.get("miss") or {}, off.get("hit") or {}
    for tag, got in (("fill", off.get("fill") or {}), ("miss", miss), ("hit", hit)):
        if "layer" not in got:
            return f"undecided: the guard-off {tag} process: {got.get('error', 'not run')}"
    if miss["layer"] != "xla" or not any(e.get("store") == "written" for e in miss["cache_events"]):
        return (f"undecided: the guard-off aot miss was not served by JAX's cache and stored (layer "
                f"{miss['layer']}): nothing was tested")
    failed = [e["quarantined"] for e in hit["cache_events"] if "failed on its first run" in e.get("quarantined", "")]
    if failed:
        return f"keep {platform!r} out of XLA_SERIALISE_SAFE_PLATFORMS: the bug is there: {failed[0]}"
    bad = [e["quarantined"] for e in hit["cache_events"] if "quarantined" in e]
    if hit["layer"] != "aot" or bad:
        return f"undecided: the guard-off entry was not served (layer {hit['layer']}; {'; '.join(bad) or 'no hit'})"
    if not hit.get("pixels_vs_fill", {}).get("identical"):
        return (f"keep {platform!r} out of XLA_SERIALISE_SAFE_PLATFORMS: the entry ran, pixels differ: "
                f"{hit.get('pixels_vs_fill')}")
    return f"add {platform!r} to XLA_SERIALISE_SAFE_PLATFORMS: the entry ran in a new process, pixels identical"


# ---------------------------------------------------------------------------------------------
# Rows 3-5: JAX against torch.compile on full-size random-weight folders


def flops_child(spec: dict[str, Any]) -> dict[str, Any]:
    """(child) The measured bf16 matrix rate, and the denoiser's matrix FLOPs per image for one
    call of ``spec`` (counted from the jaxpr of one model call, times the model calls per image)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import preheat

    pipe = preheat.load(spec["folder"], dtype=spec["dtype"], cache="off")
    ceilings = _ceilings(spec["matmul_n"], spec["copy_mib"], spec["ceiling_repeats"])
    kw = dict(steps=spec["steps"], seed=0, **spec["kwargs"])
    sig, prepared = pipe.prepare(1, **kw)
    h, w, c = sig.sample_shape
    batch = 2 if sig.guided else 1
    sds = lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype)  # noqa: E731
    cond, uncond = prepared[3], prepared[4]
    model_cond = jax.tree.map(lambda a, b: np.concatenate([a, b]), cond, uncond) if sig.guided else cond
    args = (jax.tree.map(sds, pipe.params), jax.ShapeDtypeStruct((batch, h, w, c), jnp.dtype(pipe.dtype)),
            jax.ShapeDtypeStruct((batch,), jnp.float32), jax.tree.map(sds, model_cond))
    per_call = matrix_flops(_jaxpr_with_xla_attention(pipe.apply, args))
    calls = spec["steps"] * sig.spec.max_model_calls_per_step
    return {"ceilings": ceilings, "matrix_flops_per_model_call": per_call, "model_calls_per_image": calls,
            "matrix_flops_per_image": per_call * calls, "guided": sig.guided}


def _write_image(path: Path, size: int) -> None:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def step_head_to_head(r: Runner, h: HeadToHead) -> dict[str, Any]:
    """One of rows 3-5: random weights in a child, then ``preheat bench compare`` (JAX against
    torch.compile: cold and warm start -> first image, s/image), then the matrix-peak fraction.
    The weights are deleted after the row (FLUX.1-dev's 33 GB twice would not fit the disk)."""
    import shutil

    try:
        return _head_to_head(r, h)
    finally:
        shutil.rmtree(r.work / h.row, ignore_errors=True)


def _head_to_head(r: Runner, h: HeadToHead) -> dict[str, Any]:
    out: dict[str, Any] = {"title": h.title, "model": h.model}
    need = r.needs("h2h_weights", h.row) + r.needs("h2h", h.row)
    if r.left() < need:
        return {**out, "skipped": f"budget: needs at least {need:.0f} s (random weights + one cold compile "
                                  f"per path), {max(0.0, r.left()):.0f} s left"}
    base = r.work / h.row
    base.mkdir()
    timeout = r.fits("h2h_weights", h.row)
    spec = json.dumps({"arch": h.model, "dtype": "bfloat16", "out": str(base)})
    p = r.run(f"{h.row}: random weights", [sys.executable, str(Path(__file__).resolve()), "materialize", spec],
              timeout or 1, env={"JAX_PLATFORMS": "cpu"})  # torch writes them (on the GPU when it has one)
    made = p.result()
    if made is None:
        return {**out, "error": f"random weights: {_fail(p) or 'no result'}"}
    out.update(params=made["params"], weights_bytes=made["weights_bytes"], weights_s=p.seconds)
    args = list(h.args)
    if h.image:
        image = base / "reference.png"
        _write_image(image, h.image)
        args += ["--image", str(image)]
    timeout = r.fits("h2h", h.row)
    if timeout is None:
        return {**out, "skipped": "budget (after the random weights)"}
    dest = base / "compare.json"
    cmd = [sys.executable, "-m", "preheat", "bench", "compare", made["path"], *args,
           "--timeout", f"{max(30.0, 0.45 * timeout):.0f}", "--report", str(dest)]
    p = r.run(f"{h.row}: bench compare", cmd, timeout)
    if not dest.is_file():
        return {**out, "error": _fail(p) or "no JSON written", "seconds": p.seconds}
    data = json.loads(dest.read_text())
    out.update(seconds=p.seconds, settings=data.get("settings"), goals=data.get("goals"), paths={})
    for name, path in data.get("paths", {}).items():
        steady = (path.get("steady") or {}).get("1") or {}
        start = {state: (path[state].get("process_start_to_first_image_s") or {}).get("median")
                 for state in ("empty", "warm")}
        s_per_image = (steady.get("per_image_s") or {}).get("median")
        out["paths"][name] = {"s_per_image": s_per_image, "images_per_s": steady.get("images_per_s"),
                              "empty_start_s": start["empty"], "warm_start_s": start["warm"],
                              "errors": path.get("errors"), "agreement": path.get("agreement_vs_torch_eager")}
    if h.count_flops:
        timeout = r.fits("flops")
        if timeout is None:
            out["flops"] = {"skipped": "budget"}
        else:
            settings = data.get("settings") or {}
            kwargs = {k: v for k, v in (settings.get("inputs") or {}).items() if k in ("prompt", "width", "height")}
            kwargs.update(sampler=settings.get("sampler"), guidance=settings.get("guidance"))
            lim = r.limits
            fspec = json.dumps({"folder": made["path"], "dtype": "bfloat16", "steps": settings.get("steps"),
                                "kwargs": kwargs, "matmul_n": lim["matmul_n"], "copy_mib": lim["copy_mib"],
                                "ceiling_repeats": lim["ceiling_repeats"]})
            fp = r.run(f"{h.row}: matrix FLOPs and the bf16 peak",
                       [sys.executable, str(Path(__file__).resolve()), "flops", fspec], timeout)
            flops = fp.result() or {"error": _fail(fp) or "no result"}
            jax_s = (out["paths"].get("jax") or {}).get("s_per_image")
            if "ceilings" in flops and jax_s:
                peak = flops["ceilings"]["bf16_matmul_tflops"] * 1e12
                flops["jax_matrix_fraction_of_peak"] = flops["matrix_flops_per_image"] / jax_s / peak
            out["flops"] = flops
    jax_s = (out["paths"].get("jax") or {}).get("s_per_image")
    torch_s = next((p["s_per_image"] for n, p in out["paths"].items() if n != "jax" and p.get("s_per_image")), None)
    if jax_s and torch_s:
        out["torch_over_jax_s_per_image"] = torch_s / jax_s
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


def _s(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _text_target_rows(x: dict[str, Any] | None, prep: dict[str, Any], mode: str | None) -> list[str]:
    """Row 2's text-model lines: each stage's layer on the carried root, against its own compile."""
    if not x:
        return []
    name = (f"tiny SD 1.x folder compiled on the CPU for h200 ({prep.get('entries', '?')} entries: "
            f"{', '.join(prep.get('stages') or [])}; unrunnable: {'; '.join(prep.get('unrunnable') or []) or 'none'})")
    out = []
    for tag, what in (("carried", "load"), ("device_compile", "the same call compiled on this device")):
        row = x.get(tag)
        if not row:
            continue
        if "error" in row:
            out.append(f"| {name}: {what} | – | FAILED: {row['error']} |")
            continue
        layers = ", ".join(f"{e.get('stage', 'denoise')} {e.get('layer')}" for e in row["cache_events"] if e.get("layer"))
        hit = ""
        if tag == "carried":
            hit = "HIT: every stage aot; " if row["layer"] == "aot" else \
                "MISS (expected: a CPU never loads a GPU entry); " if mode == "dry" else "NOT ALL AOT; "
        why = "; ".join(e.get("miss") or e.get("quarantined") or "" for e in row["cache_events"]
                        if e.get("miss") or e.get("quarantined"))
        out.append(f"| {name}: {what} | {_s(row.get('process_start_to_first_image_s'), 1)} | {hit}layers {layers}; "
                   f"start → first image {_s(row.get('process_start_to_first_image_s'))} s"
                   + (f"; {why[:300]}" if why else "") + " |")
    return out + _pixels_rows(name, x.get("pixels_vs_device_compile"))


def _pixels_rows(name: str, px: dict[str, Any] | None) -> list[str]:
    """Row 2's pixels line: the carried executable's image against the on-device compile's."""
    if not px:
        return []
    same = "identical" if px.get("identical") else \
        f"differ: max {px.get('max_abs')} levels, mean {px.get('mean_abs', 0):.3f}"
    return [f"| {name}: pixels against the on-device compile | – | {same} |"]


def _target_rows(t: dict[str, Any] | None) -> list[str]:
    """Row 2's lines: the hit, pixels, images/s, and what autotune-and-replace measured."""
    name = "executables compiled on the CPU for h200"
    if t is None:
        return []
    if t.get("error") or (isinstance(t.get("skipped"), str)):
        return [f"| {name} | – | {t.get('error') or 'skipped: ' + t['skipped']} |"]
    prep = t.get("prepared") or {}
    ts = prep.get("set") or {}
    head = (f"{name} ({prep.get('entries', '?')} entries, {(prep.get('bytes') or 0) / 2**20:.2f} MiB carried; "
            f"built-in model, batch {ts.get('n')}, {ts.get('steps')} steps, {ts.get('dtype')})")
    out = []
    a, b = t.get("carried"), t.get("device_compile")
    if a:
        if "error" in a:
            out.append(f"| {head}: load | – | FAILED: {a['error']} |")
        else:
            hit = "HIT (no trace, no compile)" if a["layer"] == "aot" else \
                "MISS" + (" (expected: a CPU never loads a GPU entry)" if t.get("mode") == "dry" else "")
            why = "; ".join(e.get("miss") or e.get("quarantined") or "" for e in a["cache_events"]
                            if e.get("miss") or e.get("quarantined"))
            out.append(f"| {head}: load | {_s(a.get('process_start_to_first_image_s'), 1)} | layer {a['layer']}: {hit}; "
                       f"load {_s(a.get('compile_or_load_s'), 3)} s, start → first image "
                       f"{_s(a.get('process_start_to_first_image_s'))} s" + (f"; {why[:300]}" if why else "") + " |")
    if b:
        detail = b.get("error") or (f"layer {b['layer']}; trace+lower {_s(b.get('trace_lower_s'))} s, compile "
                                    f"{_s(b.get('compile_or_load_s'))} s, start → first image "
                                    f"{_s(b.get('process_start_to_first_image_s'))} s")
        out.append(f"| {name}: the same call compiled on this device | "
                   f"{_s(b.get('process_start_to_first_image_s'), 1)} | {detail} |")
    out += _pixels_rows(name, t.get("pixels_vs_device_compile"))
    out += _text_target_rows(t.get("text"), (t.get("prepared") or {}).get("text") or {}, t.get("mode"))
    ips = t.get("images_per_s") or {}
    if ips:
        parts = [f"{tag} {x['images_per_s']:.2f} images/s (first call layer {x['first_call_layer']})"
                 if "images_per_s" in x else f"{tag}: {x.get('error')}" for tag, x in ips.items()]
        c, d = (ips.get("carried") or {}).get("images_per_s"), (ips.get("device") or {}).get("images_per_s")
        layer = (ips.get("carried") or {}).get("first_call_layer")
        # a carried root that missed serves its own on-device compile: no ratio of the carried entry's speed
        ratio = ("" if not (c and d) else f"; carried / on-device {c / d:.3f}×" if layer == "aot" else
                 f"; no carried ratio: the carried root served its own compile (layer {layer}), not the entry")
        out.append(f"| {name}: images/s | – | {'; '.join(parts)}{ratio} |")
    rt = t.get("retune")
    if rt:
        tuned = [e for e in rt.get("entries") or [] if isinstance(e.get("retune"), dict)]
        if rt.get("error"):
            detail = f"FAILED: {rt['error']}"
        elif tuned:
            detail = "; ".join(f"{e['key']}: {1e3 * e['retune']['deviceless_s']:.3g} ms deviceless, "
                               f"{1e3 * e['retune']['autotuned_s']:.3g} ms autotuned → "
                               f"{'replaced' if e['retune']['replaced'] else 'kept'}" for e in tuned)
        else:
            detail = "no entry retuned (" + ", ".join(sorted({str(e.get('target')) for e in rt.get('entries') or []})) + \
                     " entries; a CPU does not autotune)"
        out.append(f"| {name}: `preheat warm` here, autotune and replace | {rt['seconds']:.0f} | {detail} |")
    for part in t.get("skipped") or []:
        out.append(f"| {name}: {part.split(':')[0]} | – | skipped ({part.split(':', 1)[-1].strip()}) |")
    return out


def _head_to_head_rows(h: HeadToHead, res: dict[str, Any] | None) -> list[str]:
    if res is None:
        return []
    head = h.title
    if res.get("skipped") or res.get("error"):
        return [f"| {head} | – | {('FAILED: ' + res['error']) if res.get('error') else 'skipped: ' + res['skipped']} |"]
    parts = []
    for name, p in res.get("paths", {}).items():
        err = f" ({len(p['errors'])} failed)" if p.get("errors") else ""
        parts.append(f"{name} {_s(p['s_per_image'], 3)} s/image, start → first image cold "
                     f"{_s(p['empty_start_s'], 1)} s, warm {_s(p['warm_start_s'], 1)} s{err}")
    ratio = res.get("torch_over_jax_s_per_image")
    if ratio:
        parts.append(f"torch / JAX s/image {ratio:.2f}×")
    fl = res.get("flops") or {}
    if "jax_matrix_fraction_of_peak" in fl:
        parts.append(f"JAX at {_pct(fl['jax_matrix_fraction_of_peak'])} of the measured bf16 peak "
                     f"{fl['ceilings']['bf16_matmul_tflops']:.3g} TFLOP/s ({fl['matrix_flops_per_image'] / 1e12:.3g} "
                     "TFLOP of denoiser matrix work per image)")
    elif fl:
        parts.append(f"peak fraction: {fl.get('error') or fl.get('skipped')}")
    params = f"{res['params'] / 1e6:,.1f} M params, weights written in {res.get('weights_s', 0):.0f} s; " \
        if res.get("params") else ""
    return [f"| {head} | {res.get('seconds', 0):.0f} | {params}{'; '.join(parts)} |"]


def _fp8_rows(res: dict[str, Any] | None) -> list[str]:
    if res is None:
        return []
    if "fp8" not in res:
        why = ("FAILED: " + res["error"]) if res.get("error") else f"skipped: {res.get('skipped')}"
        return [f"| scaled-fp8 Linear vs bf16 GEMM | – | {why} |"]
    head = f"scaled-fp8 Linear {res['n']}² × {res['tokens']} tokens vs bf16 GEMM ({res['device']})"
    fp8, bf16 = res["fp8"], res["bf16"]
    shown = "; ".join(f"{k['op']} {k['name'] or '?'} -> {k['output'].split('{')[0]}"
                      f"{' (GEMM)' if k['gemm'] else ''}{' reads ' + k['reads_fp8'] if k['reads_fp8'] else ''}"
                      for k in fp8["kernels"])
    return [f"| {head} | {res['seconds']:.0f} | one GEMM on the fp8 weight: "
            f"{'yes' if fp8['one_gemm_on_fp8'] else 'NO'} ({len(fp8['kernels'])} kernel(s): {shown}); "
            f"fp8 {fp8['ms_per_call']:.4g} ms vs bf16 {bf16['ms_per_call']:.4g} ms a call "
            f"({res['fp8_over_bf16']:.2f}×; bf16 at {res['bf16_tflops']:.3g} TFLOP/s); "
            f"mean |Δ| {res['mean_abs_delta']:.2g} of the bf16 output |"]


def _fp8unet_rows(res: dict[str, Any] | None) -> list[str]:
    """Row 7's lines: per UNet, ms/step of each way, gemm/conv per round, agreement; the decision."""
    if res is None:
        return []
    out = []
    for model in FP8_UNETS:
        m = res.get(model) or {}
        if "ways" not in m:
            why = ("FAILED: " + m["error"]) if m.get("error") else f"skipped: {m.get('skipped', 'not run')}"
            out.append(f"| fp8 UNet step ({model}): 1x1 convs as GEMMs on fp8 vs convolutions | – | {why} |")
            continue
        w, a, g = m["ways"], m["agreement"], m["gemm_over_conv"]
        ms = "; ".join(f"{way} {_s(w[way]['ms_per_step']['median'], 3)} ms ({_s(w[way]['ms_per_step']['min'], 3)}–"
                       f"{_s(w[way]['ms_per_step']['max'], 3)}; compiled in {w[way]['compile_s']:.0f} s, "
                       f"{w[way]['traced_convs']} convs traced, {w[way]['cudnn_convs'] + w[way]['xla_convs']} compiled)"
                       for way in ("gemm", "conv", "bf16"))
        err = a["error_vs_float32"]
        agree = (f"{'agree' if a['ok'] else 'DISAGREE'} (mean |Δ| / mean |ε| against float32: "
                 + ", ".join(f"{way} {err[way]['mean']:.2g}" for way in ("gemm", "conv", "bf16"))
                 + f"; fp8 ways' bound {a['bound']:.2g} = {a['ratio']:g}× bf16's + {a['floor']:g})")
        out.append(f"| fp8 UNet step: {m['title']}, batch 1 + CFG, {m['fp8_pointwise_convs']} fp8 1x1 convs "
                   f"({m['device']}) | {m['seconds']:.0f} | ms/step {ms}; gemm / conv {g['median']:.3f}× "
                   f"({g['min']:.3f}–{g['max']:.3f} over {m['rounds']} rounds): {m['verdict']}; fp8 gemm / bf16 "
                   f"{m['fp8_gemm_over_bf16']:.3f}×; {agree} |")
    out.append(f"| fp8 UNet step: decision (docs/gpu.md) | – | {res.get('decision', '–')} |")
    return out


def _xlaser_rows(res: dict[str, Any] | None) -> list[str]:
    """Row 8's lines: what the guard-off entry did in a new process, the guard's cost, the decision."""
    if res is None:
        return []
    head = "XLA serialisation bug (entry from JAX's cache, new process)"
    if "off" not in res:
        why = ("FAILED: " + res["error"]) if res.get("error") else f"skipped: {res.get('skipped')}"
        return [f"| {head} | – | {why} |"]

    def part(guard: str, tag: str) -> str:
        got = (res.get(guard) or {}).get(tag) or {}
        if "layer" not in got:
            return f"{tag} {got.get('error', 'not run')}"
        quarantined = [e["quarantined"] for e in got["cache_events"] if "quarantined" in e]
        px = got.get("pixels_vs_fill")
        served = " → ".join(e["layer"] for e in got["cache_events"] if "layer" in e) or got["layer"]
        return (f"{tag} {served} {_s(got['compile_or_load_s'])} s"
                + (f", QUARANTINED: {quarantined[0][:160]}" if quarantined else "")
                + ("" if px is None else ", pixels vs fill " + ("identical" if px.get("identical")
                                                                 else f"differ (max {px.get('max_abs')})")))

    off = "; ".join(part("off", t) for t in ("fill", "miss", "hit"))
    on = "; ".join(part("on", t) for t in ("miss", "hit"))
    skipped = f"; skipped: {', '.join(res['skipped'])}" if res.get("skipped") else ""
    return [f"| {head}, {res['platform']}: guard off | – | {off}{skipped} |",
            f"| {head}, {res['platform']}: guard on (the aot miss compiled fresh) | – | {on} |",
            f"| {head}: decision (docs/gpu.md) | – | {res.get('verdict', '–')} |"]


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
        pt = d.get("pod_target")
        if pt:
            detail = (pt.get("skipped") or pt.get("error") or
                      f"{pt['file']}; the key's GPU fields {'equal' if pt['key_fields_equal'] else 'DIFFER from'} "
                      "XLA's h200 file's; fields that differ (h200 file, this card): "
                      + (", ".join(f"{k} {a} / {b}" for k, (a, b) in pt["differs"].items()) or "none"))
            rows.append(f"| doctor: this card's description | – | {detail} |")
    rows += _target_rows(results.get("rows", {}).get("target"))
    for h in HEAD_TO_HEAD[results["mode"]]:
        rows += _head_to_head_rows(h, results.get("rows", {}).get(h.row))
    rows += _fp8_rows(results.get("rows", {}).get("fp8"))
    rows += _fp8unet_rows(results.get("rows", {}).get("fp8unet"))
    rows += _xlaser_rows(results.get("rows", {}).get("xlaser"))
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
    elif cmp_ and cmp_.get("skipped") != "not selected":
        why = cmp_.get("error") or f"skipped: {cmp_.get('skipped')}"
        rows.append(f"| bench compare --quick (built-in model) | – | {why} |")
    skipped = f"; left out: {', '.join(results['skipped_steps'])}" if results.get("skipped_steps") else ""
    skipped += f"; rows: {', '.join(results['rows_run'])}" if results.get("rows_run") else ""
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


def _rows_selected(mode: str, r: Runner) -> tuple[list[str], list[str]]:
    """(rows to run, rows GPU_CHECK_SKIP left out) from GPU_CHECK_ROWS (default ``DEFAULT_ROWS``)
    and GPU_CHECK_SKIP; unknown names are said. A row left out by GPU_CHECK_SKIP counts as not
    run (exit 1), one that GPU_CHECK_ROWS does not name was not asked for."""
    def names(var: str) -> set[str]:
        return {x.strip() for x in os.environ.get(var, "").split(",") if x.strip()}

    chosen, skip = names("GPU_CHECK_ROWS") or set(DEFAULT_ROWS[mode]), names("GPU_CHECK_SKIP")
    unknown = (chosen | skip) - set(ROWS)
    if unknown:
        r.say(f"GPU_CHECK_ROWS/GPU_CHECK_SKIP: unknown row(s) {', '.join(sorted(unknown))}; known: {', '.join(ROWS)}")
    rows = [x for x in ROWS if x in chosen and x not in skip]
    return rows, sorted(skip & set(ROWS))


def run(out: Path, mode: str, budget: float, started_at: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    deadline = started_at + budget
    results: dict[str, Any] = {"mode": mode, "budget_s": budget, "setup_s": time.time() - started_at}
    pre = out / "preflight.json"
    results["preflight"] = json.loads(pre.read_text()) if pre.is_file() else None
    repo = Path(__file__).resolve().parents[1]
    carried = Path(os.environ.get(TARGETS_DIR_ENV) or repo / ".gpu-targets").resolve()
    failed = False
    with tempfile.TemporaryDirectory(prefix="preheat-gpu-") as tmp:
        r = Runner(out, Path(tmp), mode, deadline)
        rows, results["skipped_steps"] = _rows_selected(mode, r)
        results["rows_run"] = rows
        results["doctor"] = step_doctor(r) if "doctor" in rows else {"skipped": "not selected"}
        gpu_ok = mode != "gpu" or results["doctor"].get("gpu_backend") is True
        failed |= results["doctor"].get("exit") not in (0, None) or "skipped" in results["doctor"]
        models = MODELS if mode == "gpu" else DRY_MODELS
        results["models"] = []
        results["rows"] = {}
        if gpu_ok:
            if "target" in rows:  # 2.
                results["rows"]["target"] = {}
                _guard(r, results["rows"]["target"],
                       lambda: results["rows"]["target"].update(step_target(r, carried)))
            for h in HEAD_TO_HEAD[mode]:  # 3.-5.
                if h.row in rows:
                    results["rows"][h.row] = {}
                    _guard(r, results["rows"][h.row], lambda h=h: results["rows"][h.row].update(step_head_to_head(r, h)))
            if "fp8" in rows:  # 6.
                results["rows"]["fp8"] = {}
                _guard(r, results["rows"]["fp8"], lambda: results["rows"]["fp8"].update(step_fp8(r)))
            if "fp8unet" in rows:  # 7.
                results["rows"]["fp8unet"] = {}
                _guard(r, results["rows"]["fp8unet"], lambda: results["rows"]["fp8unet"].update(step_fp8unet(r)))
            if "xlaser" in rows:  # 8.
                results["rows"]["xlaser"] = {}
                _guard(r, results["rows"]["xlaser"], lambda: results["rows"]["xlaser"].update(step_xlaser(r)))
            runs = [ModelRun(r, m) for m in models] if "models" in rows else []
            for mr in runs:
                _guard(r, mr.res, mr.first)
            results["compare"] = {"skipped": "not selected"}
            if "compare" in rows:
                results["compare"] = {}
                _guard(r, results["compare"], lambda: results["compare"].update(step_compare(r)))
            for mr in runs:
                if "scaling" in rows and mr.m.name == SCALING_MODEL[mode] and mr.folder is not None:
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
            for name, row in results["rows"].items():
                failed |= bool(row.get("error") or (row.get("skipped") and name != "target") or
                               (name == "target" and (row.get("skipped") or not row.get("carried"))))
            failed |= bool(results["skipped_steps"]) or ("compare" in rows and (
                "paths" not in results["compare"] or any(p.get("errors") for p in results["compare"]["paths"].values())))
        else:
            r.say("JAX does not compute on a GPU (doctor above): the GPU measurements are skipped")
            results["models_skipped"] = "no GPU backend"
            results["compare"] = {"skipped": "no GPU backend"}
            gpu_rows = ("target", "sdxl", "flux", "kontext", "fp8", "fp8unet", "xlaser")
            results["rows"] = {x: {"skipped": "no GPU backend"} for x in rows if x in gpu_rows}
        results["total_s"] = time.time() - started_at
        (out / "models.json").write_text(json.dumps(results["models"], indent=2, default=str) + "\n")
        (out / "rows.json").write_text(json.dumps(results["rows"], indent=2, default=str) + "\n")
        try:
            text = table(results)
        except Exception as exc:  # the JSON is written; never end without a last word
            failed = True
            text = f"(no table: {type(exc).__name__}: {exc}; see rows.json, models.json, compare.json, log.txt)"
        (out / "summary.md").write_text(text + "\n")
        r.say(f"done: {'some steps failed or were skipped' if failed else 'all steps ran'}; files in {out}")
        r.log.close()
    print("\n" + text, flush=True)
    return 1 if failed else 0


def main() -> int:
    children = {"steady": steady_child, "scaling": scaling_child, "images": images_child, "flops": flops_child,
                "fp8": fp8_child, "fp8unet": fp8unet_child,
                "materialize": lambda spec: materialize(spec["arch"], spec["dtype"], Path(spec["out"]))}
    if len(sys.argv) == 3 and sys.argv[1] in children:
        result = children[sys.argv[1]](json.loads(sys.argv[2]))
        print(RESULT_TAG + json.dumps(result, default=str), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("run", "prepare"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mode", choices=("gpu", "dry"), required=True)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole check, setup included")
    ap.add_argument("--started-at", type=float, default=None, help="epoch seconds the check started")
    args = ap.parse_args()
    if args.command == "prepare":
        return prepare(args.out.resolve(), args.mode)
    return run(args.out, args.mode, args.budget, args.started_at or time.time())


if __name__ == "__main__":
    raise SystemExit(main())
