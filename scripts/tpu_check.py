"""The accelerator check for a TPU VM: what preheat does on this chip, as a new user would run it.

Run on the TPU machine from a copy of the repository (nothing downloaded there: the runtime's
packages come from the machine's own index or from carried wheels, installed beside its jax):

    python3 scripts/tpu_check.py --rows peak,doctor,builtin,pixels,aot,sd15   # one call, <= 10 min
    python3 scripts/tpu_check.py --rows peak,sdxl                             # a second call
    python3 scripts/tpu_check.py --rows peak,flux-schnell,flux-dev --budget-s 530   # FLUX.1, one call
    python3 scripts/tpu_check.py --rows flux-kontext,flux-fill --peak-tflops 165      # Kontext and Fill

Each row runs in fresh processes (one program may hold the chip at a time, and a cold start is
a new process by definition): ``peak`` an 8192^3 bf16 matrix product (the measured peak every
fraction is taken of); ``doctor``; ``builtin`` the built-in model cold (empty cache) then warm;
``pixels`` the built-in text model on the chip against the same call on this host's CPU (mean
|diff| in 1/255); ``aot`` executables compiled on a CPU builder (``scripts/tpu_prepare.sh``:
``preheat warm --target v5e``, carried as .tpu-aot/) loaded here, against the chip's own compile
(``scripts/tpu_aot.py check``); ``sd15`` / ``sdxl`` random
weights written here from the published configs (``bench.random_weights``: no torch), each batch
cold in a new process, then warm. FLOPs per image-step come from XLA's cost analysis of the
UNet's lowered program on the host's CPU (``flops_per_image_step``, in a subprocess). Results:
``$OUT/tpu_check.json`` and a Markdown table on stdout. ``--dry`` runs the rows on this host's CPU
at tiny image sizes: a check of the script before device time is spent on it (minutes: the
architectures are full size); no test runs it.

``flux-schnell`` / ``flux-dev``: FLUX.1 at 1024², batch 1, loaded as a v5e chip holds it (``--dtype
bfloat16 --weights-dtype int8 --weights-layers linear --encoders-on offload``: the int8 transformer,
11.1 GiB, on the chip; T5-XXL and CLIP in the chip's pinned host memory, streamed to it a block at a
time while prompts are encoded; ``TPU_CHECK_ENCODERS_ON=host`` runs them on the host's CPU instead,
the fourth session's rows). The folders are written
here first (``bench.random_weights``, full depth: the transformer's matrices in fp8, 21.6 GB for dev,
the schnell folder hard-linked to it but for its transformer's config), timed apart (``write``). Then,
each a new ``preheat sample`` process whose chip memory (``memory_stats()``: ``peak_bytes_in_use``) is
read at its exit: schnell cold (empty cache: start -> first image), schnell warm (same cache: start ->
first image, then a second call: s/image), dev cold with a second call (its 28-step s/image; its warm
start is schnell's, one compile more). Measured on the v5e (docs/tpu.md, T5 streamed): write 65 s,
schnell cold about 65 s, warm about 40 s, dev about 100 s: one call of ``--budget-s 530``; a row that would not
fit what is left is skipped and says so. The fraction of peak is taken of the transformer's FLOPs
(``bench.flux_flops``: 74.4 TFLOP a step at 1024²) over the steady call's seconds, and over its
denoising stage alone (the encode stage is apart: ``stages``). Schnell's T5 prompt is 256 tokens
(its model card's ``max_sequence_length``), dev's 512 (FluxPipeline's default).

``flux-kontext`` / ``flux-fill``: FLUX.1 Kontext dev and Fill dev with the same load options, cold with
a second call, 28 steps at 1024² (dev's count; Fill's own default is 50), each pipeline's guidance:
Kontext edits a 1024² reference image (its tokens double the transformer's sequence: 8192 + 512),
Fill repaints the masked half of a 1024² image. Their folders link dev's files (Fill writes its own
transformer: its input layer takes the masked image and the mask too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
START = time.monotonic()

# name -> (architecture, width, steps, guidance, sampler, batches)
MODELS: dict[str, tuple[str, int, int, float, str, tuple[int, ...]]] = {
    "sd15": ("sd15", 512, 20, 7.5, "ddim", (1, 8)),
    "sdxl": ("sdxl", 1024, 30, 5.0, "euler", (1, 4)),
}
DRY_WIDTH = 64  # --dry: tiny images, 2 steps

# name -> (steps, guidance or None, T5 tokens, its image flags); FLUX.1 at 1024², batch 1
FLUX: dict[str, tuple[int, Optional[float], int, tuple[str, ...]]] = {
    "flux-schnell": (4, None, 256, ()), "flux-dev": (28, 3.5, 512, ()),
    "flux-kontext": (28, 2.5, 512, ("image",)), "flux-fill": (28, 30.0, 512, ("image", "mask"))}
FLUX_WIDTH = 1024
FLUX_LOAD = ["--dtype", "bfloat16", "--weights-dtype", "int8", "--weights-layers", "linear", "--encoders-on",
             os.environ.get("TPU_CHECK_ENCODERS_ON", "offload")]
# `preheat sample` in-process, the chip's memory counters written at exit (its atexit handlers run)
_WITH_MEMORY = """
import atexit, json, os, sys
def _memory():
    try:
        import jax
        stats = jax.devices()[0].memory_stats() or {}
        out = {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit", "largest_alloc_size")}
    except Exception as exc:
        out = {"error": str(exc)[:300]}
    with open(os.environ["TPU_CHECK_MEMORY"], "w") as f:
        json.dump(out, f)
atexit.register(_memory)
sys.argv = ["preheat", *sys.argv[1:]]
from preheat.cli import run
run()
"""


def left(budget: float) -> float:
    return budget - (time.monotonic() - START)


def run(cmd: list[str], timeout: float, env: Optional[dict[str, str]] = None, log: Optional[Path] = None) -> dict[str, Any]:
    """One fresh process; its wall time, exit code and the tail of its output."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                           timeout=max(timeout, 1))
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = "timeout", (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else str(exc.stdout or "")
    if log is not None:
        log.write_text(out)
    return {"rc": rc, "wall_s": round(time.monotonic() - t0, 2), "tail": out[-800:]}


def sample(model: str, home: Path, out: Path, batch: int, extra: list[str], timeout: float, tag: str,
           timing: bool = True, memory: bool = False) -> dict[str, Any]:
    """``preheat sample`` in a new process; the JSON it prints, with the process's wall time.
    ``timing``: a second call too (s/image); ``memory``: the chip's memory counters at its exit."""
    report = out / f"{tag}.json"
    head = [sys.executable, "-c", _WITH_MEMORY] if memory else [sys.executable, "-m", "preheat"]
    cmd = [*head, "sample", model, "--n", str(batch), "--out", str(out / f"{tag}.png"),
           "--save-images", str(out / tag), "--report", str(report), "--quiet", *extra]
    if timing and "--timing" in _sample_help():
        cmd.append("--timing")
    env = {"PREHEAT_HOME": str(home)}
    if memory:
        env["TPU_CHECK_MEMORY"] = str(out / f"{tag}.memory.json")
    r = run(cmd, timeout, env, out / f"{tag}.log")
    if report.is_file():
        data = json.loads(report.read_text())
        r.update({k: data.get(k) for k in ("process_start_to_first_image_s", "load_s", "trace_lower_s", "compile_s",
                                           "compile_or_load_s", "first_call_s", "second_call_s", "per_image_s",
                                           "cache_layer", "import_s", "weights_read_s", "peak_host_bytes")})
        r["stages"] = {name: {k: stage.get(k) for k in ("run_s", "compile_s", "cache_layer")}
                       for name, stage in (data.get("stages") or {}).items()}
        # the start's phases (``startup.phases``): ``executable.compile`` is the whole program's cold
        # compile, its stages at once beside the weights' read (a stage's own compile_s is the wait for it)
        r["phases_s"] = {name: round(phase["seconds"], 2)
                         for name, phase in ((data.get("startup") or {}).get("phases") or {}).items()}
    if memory and (out / f"{tag}.memory.json").is_file():
        r["memory"] = json.loads((out / f"{tag}.memory.json").read_text())
    return r


def last_json(output: str) -> dict[str, Any]:
    """The last line of ``output`` that is a JSON object: a TPU runtime prints its warnings after
    a child's result (transparent hugepages, at every start). ValueError when there is none."""
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def _sample_help() -> str:
    if not hasattr(_sample_help, "text"):
        _sample_help.text = subprocess.run([sys.executable, "-m", "preheat", "sample", "--help"], cwd=ROOT,
                                           capture_output=True, text=True).stdout
    return _sample_help.text


def row_peak(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    code = ("import jax, jax.numpy as jnp, time, json; n=%d; a=jax.random.normal(jax.random.PRNGKey(0),(n,n),jnp.bfloat16);"
            "f=jax.jit(lambda a: a@a); f(a).block_until_ready(); ts=[]\n"
            "for _ in range(10):\n t=time.perf_counter(); f(a).block_until_ready(); ts.append(time.perf_counter()-t)\n"
            "ts.sort(); print(json.dumps({'tflops': 2*n**3/ts[5]*1e-12, 'device': jax.devices()[0].device_kind}))")
    r = run([sys.executable, "-c", code % (512 if args.dry else 8192)], 120)
    try:
        r.update(last_json(r["tail"]))
    except (ValueError, IndexError):
        pass
    return r


def row_doctor(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    r = run([sys.executable, "-m", "preheat", "doctor"], 120, {"COLUMNS": "160"}, out / "doctor.txt")
    r["report"] = (out / "doctor.txt").read_text()[-4000:]
    return r


def row_builtin(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    home = Path(args.work) / "home-builtin"
    return {"cold": sample("builtin:digits", home, out, 16, [], 120, "builtin-cold"),
            "warm": sample("builtin:digits", home, out, 16, [], 120, "builtin-warm")}


def _mean_diff(a: Path, b: Path) -> Optional[float]:
    import numpy as np
    from PIL import Image

    files = sorted(a.glob("*.png"))
    if not files or len(files) != len(list(b.glob("*.png"))):
        return None
    diffs = [np.abs(np.asarray(Image.open(f), np.float64) - np.asarray(Image.open(b / f.name), np.float64)).mean()
             for f in files]
    return float(np.mean(diffs))


def row_pixels(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The same call on the chip and on the host's CPU: bf16/float32 rounding apart, nothing else."""
    flags = ["--prompt", "a zero", "--prompt", "a bold four", "--steps", "20"]
    chip = sample("builtin:text-digits", Path(args.work) / "home-px-tpu", out, 2, flags, 150, "pixels-tpu")
    cpu = run([sys.executable, "-m", "preheat", "sample", "builtin:text-digits", "--n", "2", *flags, "--quiet",
               "--out", str(out / "pixels-cpu.png"), "--save-images", str(out / "pixels-cpu")], 200,
              {"JAX_PLATFORMS": "cpu", "PREHEAT_HOME": str(Path(args.work) / "home-px-cpu")})
    return {"chip": chip, "cpu": cpu, "mean_abs_diff_255": _mean_diff(out / "pixels-tpu", out / "pixels-cpu")}


def row_aot(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Entries compiled on a CPU builder for this chip (``scripts/tpu_prepare.sh``: ``warm --target
    v5e``, carried as .tpu-aot/) against the chip's own compile: ``scripts/tpu_aot.py check``."""
    carried = ROOT / ".tpu-aot"
    if not (carried / "prepare.json").is_file():
        return {"skipped": "no .tpu-aot carried (scripts/tpu_prepare.sh writes it on a CPU builder)"}
    report = out / "tpu_aot.json"
    r = run([sys.executable, "scripts/tpu_aot.py", "check", "--carried", str(carried), "--out-json", str(report)],
            400, log=out / "tpu_aot.log")
    if report.is_file():
        r.update(json.loads(report.read_text()))
    return r


def flops_per_image_step(arch: str, batch: int, width: int, guided: bool) -> Optional[float]:
    """XLA's FLOP count of one UNet call at this batch (doubled by guidance), per image: the
    host CPU lowers the program abstractly (no weights, no chip)."""
    code = f"""
import json, sys, jax, jax.numpy as jnp
sys.path.insert(0, {str(ROOT / 'src')!r})
from preheat.bench.random_models import SD15_UNET, SDXL_UNET
from preheat.models.unet2d_condition import UNet2DConditionConfig, build_abstract, LoadedUNet2DCondition
raw = dict(SDXL_UNET if {arch!r} == 'sdxl' else SD15_UNET)
cfg = UNet2DConditionConfig.from_dict(raw, 'unet')
g, a = build_abstract(cfg)
a = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.shape, jnp.bfloat16), a)
u = LoadedUNet2DCondition(config=cfg, graphdef=g, params=None, dtype=jnp.bfloat16)
S = jax.ShapeDtypeStruct
b = {batch * (2 if guided else 1)}
h = {width} // 8
ctx = S((b, 77, cfg.cross_attention_dim), jnp.bfloat16)
added = {{'text_embeds': S((b, 1280), jnp.bfloat16), 'time_ids': S((b, 6), jnp.float32)}} if {arch!r} == 'sdxl' else None
low = jax.jit(u.apply).lower(a, S((b, h, h, 4), jnp.bfloat16), S((b,), jnp.float32), ctx, added)
cost = low.cost_analysis()
cost = cost[0] if isinstance(cost, list) else cost
print(json.dumps({{'flops': cost.get('flops')}}))
"""
    r = run([sys.executable, "-c", code], 300, {"JAX_PLATFORMS": "cpu"})
    try:
        return last_json(r["tail"])["flops"] / batch
    except (ValueError, IndexError, KeyError, TypeError):
        return None


def row_model(name: str, args: argparse.Namespace, out: Path, budget: float) -> dict[str, Any]:
    arch, width, steps, guidance, sampler, batches = MODELS[name]
    if args.batches:
        batches = tuple(args.batches)
    if args.dry:
        width, steps = DRY_WIDTH, 2
    folder = Path(args.work) / f"random-{arch}"
    t0 = time.monotonic()
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'src')!r}); from preheat.bench.random_weights import "
            f"write_random_folder; write_random_folder({arch!r}, {str(folder)!r})")
    written = run([sys.executable, "-c", code], 600, {"JAX_PLATFORMS": "cpu"})
    result: dict[str, Any] = {"write": {"rc": written["rc"], "s": round(time.monotonic() - t0, 1), "tail": written["tail"][-300:]},
                              "width": width, "steps": steps, "guidance": guidance, "sampler": sampler, "batches": {}}
    flags = ["--prompt", "a photo of a red fox in the forest", "--width", str(width), "--height", str(width),
             "--steps", str(steps), "--guidance", str(guidance), "--sampler", sampler, "--dtype", "bfloat16"]
    for batch in batches:
        if left(budget) < 60:
            result["batches"][batch] = {"skipped": "budget"}
            continue
        home = Path(args.work) / f"home-{name}-{batch}"
        cold = sample(str(folder), home, out, batch, flags, left(budget) - 10, f"{name}-b{batch}-cold")
        entry: dict[str, Any] = {"cold": cold}
        flops = flops_per_image_step(arch, batch, width, guidance > 1)
        per_image = cold.get("per_image_s")
        entry["flops_per_image_step"] = flops
        if per_image:
            entry["s_per_image"] = per_image
            entry["s_per_image_step"] = per_image / steps
            if flops and args.peak_tflops:
                entry["fraction_of_peak"] = flops * steps / per_image / (args.peak_tflops * 1e12)
        result["batches"][batch] = entry
    first = result["batches"].get(batches[0], {})
    if "cold" in first and left(budget) > 90:  # the warm start last: every batch's cold row comes first
        home = Path(args.work) / f"home-{name}-{batches[0]}"
        first["warm"] = sample(str(folder), home, out, batches[0], flags, left(budget) - 10, f"{name}-b{batches[0]}-warm")
    return result


FLUX_DEV_BYTES = 21_650_000_000  # the full random FLUX.1-dev folder (fp8 transformer, bf16 T5; schnell: links)
FLUX_TRANSFORMER_BYTES = 11_950_000_000  # its fp8 transformer: FLUX.1 Fill's own


def _filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on (/proc/mounts' longest prefix): a tmpfs is memory."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    target = str(path.resolve())
    best = max((m for m in mounts if target == m[0] or target.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=["", "unknown"])
    return f"{best[1]} at {best[0]}"


def _flux_write(args: argparse.Namespace, rows: list[str]) -> tuple[dict[str, Path], dict[str, Any]]:
    """The FLUX.1 rows' folders, dev first and the others hard-linked to it where they share its files
    (Fill writes its own transformer), in a subprocess (no chip); each timed."""
    folders = {name: Path(args.work) / f"random-{name}{'-dry' if args.dry else ''}" for name in FLUX}
    configs = "SMALL_FLUX" if args.dry else "None"  # --dry: FLUX.1's layout at a CPU's size
    names = ["flux-dev", *(name for name in FLUX if name in rows and name != "flux-dev")]
    code = (f"import sys, time, json; sys.path.insert(0, {str(ROOT / 'src')!r})\n"
            "from preheat.bench.random_weights import SMALL_FLUX, write_random_folder\n"
            f"folders, took = {{k: v for k, v in {({n: str(folders[n]) for n in names})!r}.items()}}, {{}}\n"
            "for name, folder in folders.items():\n"
            "    t = time.monotonic()\n"
            f"    write_random_folder(name, folder, configs={configs}, "
            "link_from=None if name == 'flux-dev' else folders['flux-dev'])\n"
            "    took[name.replace('flux-', '') + '_s'] = round(time.monotonic() - t, 1)\n"
            "print(json.dumps(took))")
    need = 0 if args.dry or (folders["flux-dev"] / "model_index.json").is_file() else FLUX_DEV_BYTES
    if "flux-fill" in rows and not args.dry and not (folders["flux-fill"] / "model_index.json").is_file():
        need += FLUX_TRANSFORMER_BYTES
    free, fs = shutil.disk_usage(args.work).free, _filesystem(Path(args.work))
    if free < 1.05 * need:
        return folders, {"skipped": f"{args.work} has {free / 1e9:.1f} GB free ({fs}); the folders need "
                                    f"{need / 1e9:.1f} GB: give --work on a larger disk"}
    t0 = time.monotonic()
    written = run([sys.executable, "-c", code], 600, {"JAX_PLATFORMS": "cpu"})
    result: dict[str, Any] = {"rc": written["rc"], "s": round(time.monotonic() - t0, 1), "tail": written["tail"][-300:],
                              "free_bytes_before": free, "filesystem": fs}
    try:
        result.update(last_json(written["tail"]))
        result["bytes"] = {name: sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
                           for name, folder in folders.items()}
    except (ValueError, IndexError, OSError):
        pass
    return folders, result


def _flux_rates(entry: dict[str, Any], flops: Optional[float], steps: int, peak_tflops: Optional[float]) -> None:
    """s/image, s/image-step and the fractions of the measured peak, from a call timed twice."""
    per_image = entry.get("per_image_s")
    if not per_image:
        return
    denoise = (entry.get("stages") or {}).get("denoise", {}).get("run_s")  # the first call's loop (compiled already)
    entry["s_per_image_step"] = per_image / steps
    if flops and peak_tflops:
        entry["fraction_of_peak"] = flops * steps / per_image / (peak_tflops * 1e12)
        if denoise:
            entry["fraction_of_peak_denoise"] = flops * steps / denoise / (peak_tflops * 1e12)


def row_flux(name: str, args: argparse.Namespace, out: Path, budget: float) -> dict[str, Any]:
    """FLUX.1 on one chip (the module docstring): schnell cold and warm, dev cold with a steady call."""
    sys.path.insert(0, str(ROOT / "src"))
    from preheat.bench.flux_flops import flux_flops_per_call, flux_image_tokens

    steps, guidance, tokens, images = FLUX[name]
    width = DRY_WIDTH if args.dry else FLUX_WIDTH
    if args.dry:
        steps = 2
    if not hasattr(args, "flux_folders"):  # every row's folder at once: they share dev's files
        args.flux_folders, args.flux_write = _flux_write(args, args.row_names)
    folder = args.flux_folders[name]
    if "skipped" in args.flux_write:
        return {"write": args.flux_write, "skipped": args.flux_write["skipped"]}
    config = json.loads((folder / "transformer" / "config.json").read_text()) if folder.is_dir() else {}
    vae = json.loads((folder / "vae" / "config.json").read_text()) if folder.is_dir() else {}
    scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
    reference = flux_image_tokens(width, width, scale) if name == "flux-kontext" else 0  # its reference image's
    flops = flux_flops_per_call(config, width, width, tokens, scale, reference_tokens=reference)
    result: dict[str, Any] = {"write": args.flux_write, "width": width, "steps": steps, "guidance": guidance,
                              "t5_tokens": tokens, "load_options": " ".join(FLUX_LOAD),
                              "flops_per_image_step": flops}
    flags = ["--prompt", "a photo of a red fox in the forest", "--width", str(width), "--height", str(width),
             "--steps", str(steps), "--max-sequence-length", str(tokens), *FLUX_LOAD]
    if guidance is not None:
        flags += ["--guidance", str(guidance)]
    for image in images:  # Kontext's reference, Fill's image and mask (its right half repainted)
        flags += [f"--{image}", str(_flux_image(out, image, width))]
    if args.dry and name == "flux-kontext":  # the tiny VAE's scale is 2: its preferred 1024² would be 512² latents
        flags += ["--image-resize", "none"]
    home = Path(args.work) / f"home-{name}"
    shutil.rmtree(home, ignore_errors=True)  # cold: an empty cache, whatever an earlier run left
    plan = [("cold", False), ("warm", True)] if name == "flux-schnell" else [("cold", True)]
    for kind, timing in plan:
        if left(budget) < 90:
            result[kind] = {"skipped": f"budget ({left(budget):.0f} s left)"}
            continue
        entry = sample(str(folder), home, out, 1, flags, left(budget) - 10, f"{name}-{kind}", timing=timing, memory=True)
        _flux_rates(entry, flops, steps, args.peak_tflops)
        result[kind] = entry
    return result


def _flux_image(out: Path, kind: str, width: int) -> Path:
    """A width² PNG: a smooth picture (``image``), or a mask whose right half is white (``mask``)."""
    import numpy as np
    from PIL import Image

    path = out / f"{kind}.png"
    if not path.is_file():
        ramp = np.linspace(0, 255, width, dtype=np.float32)
        if kind == "mask":
            pixels = np.where(np.arange(width) >= width // 2, 255, 0).astype(np.uint8)[None, :].repeat(width, 0)
        else:
            pixels = np.stack([ramp[None, :].repeat(width, 0), ramp[:, None].repeat(width, 1),
                               np.full((width, width), 96.0)], axis=-1).astype(np.uint8)
        Image.fromarray(pixels).save(path)
    return path


def _s(x: Any) -> str:
    return f"{x:.1f}" if isinstance(x, (int, float)) else str(x)


def table(results: dict[str, Any]) -> str:
    lines = ["| row | what | measured |", "|---|---|---|"]
    peak = results.get("peak", {})
    if "tflops" in peak:
        lines.append(f"| peak | {peak.get('device')} bf16 8192^3 matmul | {peak['tflops']:.1f} TFLOP/s |")
    b = results.get("builtin")
    if b:
        for side in ("cold", "warm"):
            s = b[side]
            lines.append(f"| builtin | {side}: start -> first image (compile or load; layer) | "
                         f"{s.get('process_start_to_first_image_s')} s ({s.get('compile_or_load_s')} s; {s.get('cache_layer')}) |")
    px = results.get("pixels")
    if px:
        lines.append(f"| pixels | text-digits, chip vs host CPU, mean abs diff | {px.get('mean_abs_diff_255')} / 255 |")
    for name, m in results.get("aot", {}).get("models", {}).items():
        c, o = m.get("carried", {}), m.get("own_compile", {})
        lines.append(f"| aot | {name}: carried (layer, start -> first image) vs the chip's own compile | "
                     f"{c.get('layer')}, {c.get('process_s')} s vs {o.get('layer')}, {o.get('process_s')} s; "
                     f"pixels {m.get('pixels_vs_own_compile')} |")
    for name in FLUX:
        r = results.get(name)
        if not r:
            continue
        w = r.get("write", {})
        if "skipped" in r:
            lines.append(f"| {name} | skipped | {r['skipped']} |")
            continue
        lines.append(f"| {name} | random folders written here (dev; the others linked to it; {w.get('filesystem')}) | "
                     f"{w.get('s')} s, rc {w.get('rc')} |")
        for kind in ("cold", "warm"):
            e = r.get(kind)
            if not e:
                continue
            if "skipped" in e:
                lines.append(f"| {name} | {kind} | {e['skipped']} |")
                continue
            peak = (e.get("memory") or {}).get("peak_bytes_in_use")
            frac, frac_d = e.get("fraction_of_peak"), e.get("fraction_of_peak_denoise")
            phases, host = e.get("phases_s") or {}, e.get("peak_host_bytes")
            lines.append(f"| {name} | {kind}: start -> first image (the program's compile or load; the weights' "
                         f"read beside it; layer), peak HBM, peak host memory | "
                         f"{_s(e.get('process_start_to_first_image_s'))} s ({_s(phases.get('executable'))}; "
                         f"{_s(phases.get('weights'))}; {e.get('cache_layer')}), "
                         f"{'%.2f GiB' % (peak / 2**30) if peak else '-'}, "
                         f"{'%.1f GiB' % (host / 2**30) if host else '-'} rc {e.get('rc')} |")
            if e.get("per_image_s"):
                stages = ", ".join(f"{k} {v.get('run_s'):.2f}" for k, v in (e.get("stages") or {}).items()
                                   if v.get("run_s") is not None)
                lines.append(f"| {name} | {r['width']}^2, {r['steps']} steps: s/image (first call's stages, s), "
                             f"fraction of peak (whole call; denoising) | {e['per_image_s']:.2f} ({stages}), "
                             f"{'%.0f%%' % (100 * frac) if frac else '-'}; {'%.0f%%' % (100 * frac_d) if frac_d else '-'} |")
    for name in MODELS:
        r = results.get(name)
        if not r:
            continue
        for batch, e in r["batches"].items():
            if "cold" not in e:
                lines.append(f"| {name} | batch {batch} | {e.get('skipped')} |")
                continue
            c = e["cold"]
            frac = e.get("fraction_of_peak")
            lines.append(f"| {name} | batch {batch}, {r['width']}^2, {r['steps']} steps: s/image, s/image-step, peak | "
                         f"{e.get('s_per_image')}, {e.get('s_per_image_step')}, {'%.0f%%' % (100 * frac) if frac else '-'} |")
            phases = c.get("phases_s") or {}
            lines.append(f"| {name} | batch {batch} cold: start -> first image (trace+lower; the program's compile, "
                         f"its stages at once; the weights' read beside it) | {_s(c.get('process_start_to_first_image_s'))} s "
                         f"({_s(c.get('trace_lower_s'))}; {_s(phases.get('executable.compile'))}; "
                         f"{_s(phases.get('weights'))}) rc {c.get('rc')} |")
            if "warm" in e:
                w = e["warm"]
                wp = w.get("phases_s") or {}
                lines.append(f"| {name} | batch {batch} warm: start -> first image (the executable's load and "
                             f"the weights' read beside it; layer) | {_s(w.get('process_start_to_first_image_s'))} s "
                             f"({_s(wp.get('executable'))}, {_s(wp.get('weights'))}; {w.get('cache_layer')}) |")
    return "\n".join(lines)


ROWS = ("peak", "doctor", "builtin", "pixels", "aot", "sd15", "sdxl", *FLUX)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="peak,doctor,builtin,pixels,aot,sd15")
    parser.add_argument("--out", default=os.environ.get("OUT", "tpu-results"))
    parser.add_argument("--work", default="/tmp/preheat-tpu-check")
    parser.add_argument("--budget-s", type=float, default=560)
    parser.add_argument("--batches", type=lambda text: [int(b) for b in text.split(",")], default=None,
                        help="the sd15/sdxl rows' batch sizes, comma-separated (default: each model's own)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="default: the peak row's measurement")
    parser.add_argument("--dry", action="store_true", help="on the CPU, tiny sizes: the script's own check")
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if args.dry:
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("PYTHONPATH", "")
    # this tree's preheat first: a machine's own PYTHONPATH may name another copy
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ["PYTHONPATH"]) if p)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"rows": rows, "dry": args.dry}
    args.row_names = rows
    for row in rows:
        if left(args.budget_s) < 20:
            results[row] = {"skipped": "budget"}
            continue
        t0 = time.monotonic()
        if row in MODELS:
            results[row] = row_model(row, args, out, args.budget_s)
        elif row in FLUX:
            results[row] = row_flux(row, args, out, args.budget_s)
        else:
            results[row] = globals()[f"row_{row}"](args, out)
        if row == "peak" and args.peak_tflops is None:
            args.peak_tflops = results[row].get("tflops")
        results[row]["row_s"] = round(time.monotonic() - t0, 1)
        print(f"tpu_check: {row} done in {results[row]['row_s']} s", flush=True)
        (out / "tpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
