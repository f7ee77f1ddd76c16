"""A TPU VM's first start from executables compiled on a CPU-only builder (issue 57), both sides.

``prepare`` (on the CPU builder, in a venv with the TPU machine's versions: Python 3.11, jax and
jaxlib 0.10.2, libtpu 0.0.42.1 -- ``scripts/tpu_prepare.sh`` makes it and runs this): ``preheat warm
--target v5e`` of the built-in model and of a tiny random SD 1.x folder into ``OUT/home``, the folder
in ``OUT/sd1`` (written by diffusers in the repository's ``.venv``: the builder venv has no torch),
and ``OUT/prepare.json``: the versions, the entries, their bytes (the carry is at most 64 MiB).

``check`` (on the TPU VM, with ``OUT`` carried, this tree's preheat and the same versions): per
model, ``preheat sample`` on a copy of the carried root (the hit: layer ``aot``, no trace, lower or
compile) and on an empty root (the chip's own compile), the first call's layer and cache events,
the phase timings, and the pixels of the two against each other; then the key fields the chip
computes for itself against the carried manifests' (what differs, where an entry was missed),
the chip's device description (the recorded fixture of ``tests/_support/tpu_fixtures.py``), and
one 4096-token attention layer's flash-kernel program (``flash/``) loaded and run against the chip's
own compile of it.
One JSON object on stdout and in ``--out-json``.

    python scripts/tpu_aot.py prepare --out .tpu-aot [--target v5e]      (builder)
    python scripts/tpu_aot.py check --carried .tpu-aot --out-json $OUT/tpu_aot.json   (TPU VM)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# warm's set and the sample call that must hit it: batch 1, guidance off (sample's guidance 1), bf16
WARM_ARGS = ("--dtype", "bfloat16", "--max-batch-size", "1", "--guidance", "off", "--json", "--quiet")
SAMPLE_ARGS = ("--n", "1", "--steps", "4", "--guidance", "1", "--dtype", "bfloat16", "--seed", "0")
TEXT_WARM_ARGS = ("--inputs", "none")  # text-to-image only: three programs, the carry stays small
PROMPT = "a red fox"
CARRY_LIMIT = 64 * 2**20
# the key's device fields (the TPU platform's ``device_fields``): what the chip computes, compared
_DEVICE_KEYS = ("platform", "device_kind", "platform_version", "device_count", "xla_flags", "libtpu_init_args")


def _env(home: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PREHEAT_HOME": str(home), "PYTHONPATH": path}
    env.pop("PREHEAT_CACHE_URL", None)  # these entries travel in the tree, not through a store
    return env


def _manifests(home: Path) -> list[dict[str, Any]]:
    return [json.loads(m.read_text()) for m in sorted((home / "compile" / "jax").glob("*/manifest.json"))]


def _versions() -> dict[str, Any]:
    import jax
    import jaxlib

    from preheat.platforms import libtpu_version

    return {"python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "libtpu": libtpu_version()}


def prepare(out: Path, target: str, model_python: str) -> int:
    """(builder) The carried folder: entries for ``target``, the tiny SD 1.x folder, prepare.json."""
    shutil.rmtree(out, ignore_errors=True)
    home = out / "home"
    home.mkdir(parents=True)
    env = {**_env(home), "JAX_PLATFORMS": "cpu"}
    made = subprocess.run([model_python, "-c", "import sys; from pathlib import Path; "
                           "from preheat.bench.random_models import save_random_sd1_tiny; "
                           "save_random_sd1_tiny(Path(sys.argv[1]))", str(out / "sd1")],
                          env=env, capture_output=True, text=True)
    if made.returncode != 0:
        print(made.stderr[-3000:], file=sys.stderr)
        print(f"tpu_aot prepare: {model_python} could not write the SD 1.x folder (diffusers, torch)", file=sys.stderr)
        return 2
    info: dict[str, Any] = {"target": target, "versions": _versions(), "warm": {}}
    for name, model, extra in (("builtin", [], ()), ("sd1", [str(out / "sd1")], TEXT_WARM_ARGS)):
        cmd = [sys.executable, "-m", "preheat", "warm", *model, "--target", target, *WARM_ARGS, *extra]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
            print(f"tpu_aot prepare: `{' '.join(cmd[1:])}` failed (exit {proc.returncode})", file=sys.stderr)
            return 2
        info["warm"][name] = {"command": " ".join(cmd[3:]), "seconds": time.perf_counter() - start,
                              "result": json.loads(proc.stdout)}
    info["flash"] = _prepare_flash(out / "flash", target)
    manifests = _manifests(home)
    files = [f for f in out.rglob("*") if f.is_file()]
    info.update(entries=len(manifests), bytes=sum(f.stat().st_size for f in files),
                targets=sorted({m["target"]["name"] for m in manifests}),
                keys=[{"key": m["key"], "stage": m["fields"]["signature"].get("stage", "denoise")} for m in manifests],
                device_fields={k: manifests[0]["fields"].get(k) for k in _DEVICE_KEYS} if manifests else None,
                slice={k: manifests[0]["target"].get(k) for k in ("chips", "devices", "cores_per_device", "libtpu")}
                if manifests else None)
    (out / "prepare.json").write_text(json.dumps(info, indent=2) + "\n")
    mib = info["bytes"] / 2**20
    print(f"tpu_aot prepare: {len(manifests)} entries for {target} ({', '.join(info['targets'])}); {out} holds "
          f"{mib:.1f} MiB{' -- over the 64 MiB carry' if info['bytes'] > CARRY_LIMIT else ''}")
    return 0 if info["bytes"] <= CARRY_LIMIT else 3


# The flash row: one 4096-token self-attention layer (SDXL's first stage: 2 heads of 64, bf16), the
# Pallas kernel the TPU platform takes for it, compiled here and run there against the chip's compile
FLASH_SHAPE = (1, 4096, 2, 64)


def _flash_program() -> Any:
    from preheat.models.attention import dot_product_attention

    return lambda q, k, v: dot_product_attention(q, k, v)  # (B, L, nH, Dh) x3 -> (B, L, nH, Dh)


def _prepare_flash(out: Path, target: str) -> dict[str, Any]:
    """(builder) The flash row's program for ``target``'s chip, serialised with its trees."""
    import pickle

    import jax
    import jax.numpy as jnp
    from jax.experimental.serialize_executable import serialize

    from preheat import platforms
    from preheat.cache.compile import on_device
    from preheat.cache.targets import resolve_target, target_device

    device = target_device(resolve_target(target))
    q = jax.ShapeDtypeStruct(FLASH_SHAPE, jnp.bfloat16)
    with platforms.compiling_for("tpu"):
        compiled = jax.jit(_flash_program()).lower(*on_device((q, q, q), device)).compile()
    payload, in_tree, out_tree = serialize(compiled)
    out.mkdir(parents=True)
    (out / "executable.bin").write_bytes(payload)
    (out / "trees.pkl").write_bytes(pickle.dumps((in_tree, out_tree)))
    return {"bytes": len(payload), "kernel_call": "tpu_custom_call" in compiled.as_text()}


def _check_flash(carried: Path) -> dict[str, Any]:
    """(TPU VM) The carried flash program loaded and run here, against the chip's own compile of it."""
    import pickle

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.serialize_executable import deserialize_and_load

    if not (carried / "flash" / "executable.bin").is_file():
        return {"skipped": "no flash program carried"}
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, FLASH_SHAPE, jnp.bfloat16) for key in keys)
    in_tree, out_tree = pickle.loads((carried / "flash" / "trees.pkl").read_bytes())
    start = time.perf_counter()
    loaded = deserialize_and_load((carried / "flash" / "executable.bin").read_bytes(), in_tree, out_tree,
                                  execution_devices=jax.devices()[:1])
    load_s = time.perf_counter() - start
    carried_out = np.asarray(jax.block_until_ready(loaded(q, k, v)), np.float32)
    start = time.perf_counter()
    own = jax.jit(_flash_program()).lower(q, k, v).compile()
    compile_s = time.perf_counter() - start
    own_out = np.asarray(jax.block_until_ready(own(q, k, v)), np.float32)
    return {"load_s": load_s, "own_compile_s": compile_s, "identical": bool((carried_out == own_out).all()),
            "max_abs": float(np.abs(carried_out - own_out).max()), "own_kernel_call": "tpu_custom_call" in own.as_text()}


def _pixels_delta(a: Path, b: Path) -> dict[str, Any]:
    import numpy as np
    from PIL import Image

    x = np.asarray(Image.open(a)).astype(np.int32)
    y = np.asarray(Image.open(b)).astype(np.int32)
    if x.shape != y.shape:
        return {"identical": False, "shapes": [list(x.shape), list(y.shape)]}
    d = np.abs(x - y)
    return {"identical": bool((d == 0).all()), "max_abs": int(d.max()), "mean_abs": float(d.mean())}


def _sample(tag: str, home: Path, model: list[str], work: Path) -> dict[str, Any]:
    png, report = work / f"{tag}.png", work / f"{tag}.json"
    prompt = ["--prompt", PROMPT] if model else []
    cmd = [sys.executable, "-m", "preheat", "sample", *model, *prompt, *SAMPLE_ARGS, "--out", str(png),
           "--report", str(report), "--quiet", "--cache", "full"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(home), capture_output=True, text=True, cwd=REPO)
    row: dict[str, Any] = {"command": " ".join(cmd[3:]), "process_s": time.perf_counter() - start}
    if proc.returncode != 0 or not report.is_file():
        return {**row, "error": (proc.stdout[-1500:] + proc.stderr[-1500:]).strip()}
    rep = json.loads(report.read_text())
    row.update(layer=rep.get("cache_layer"), png=str(png),
               cache_events=[{k: v for k, v in e.items() if k in ("stage", "layer", "miss", "quarantined", "early")}
                             for e in rep.get("cache_events", [])],
               **{k: v for k, v in rep.items() if k.endswith("_s") and isinstance(v, (int, float))})
    return row


def _chip() -> dict[str, Any]:
    """This VM's devices as the key reads them, and what a recorded fixture copies."""
    import jax

    from preheat import platforms
    from preheat.platforms import libtpu_init_args, slice_description

    devices = jax.devices()
    first = devices[0]
    attrs = {}
    for name in ("platform", "device_kind", "id", "coords", "core_on_chip", "num_cores", "process_index"):
        value = getattr(first, name, None)
        attrs[name] = list(value) if isinstance(value, (tuple, list)) else value
    return {"fields": platforms.device_fields(None), "slice": slice_description(devices), "device": attrs,
            "count": len(devices),
            "coords": [list(getattr(d, "coords", [])) for d in devices],
            "platform_version": str(first.client.platform_version),
            "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""), "libtpu_init_args": libtpu_init_args(),
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}


def check(carried: Path) -> dict[str, Any]:
    """(TPU VM) The carried entries loaded here against the chip's own compile (see the module docstring)."""
    prepared = json.loads((carried / "prepare.json").read_text())
    result: dict[str, Any] = {"prepared_versions": prepared["versions"], "versions": _versions(), "models": {}}
    work = Path(tempfile.mkdtemp(prefix="tpu-aot-"))
    for name, model in (("builtin", []), ("sd1", [str(carried / "sd1")])):
        hit_home, own_home = work / f"{name}-carried", work / f"{name}-own"
        shutil.copytree(carried / "home", hit_home)
        own_home.mkdir()
        row = {"carried": _sample(f"{name}-carried", hit_home, model, work),
               "own_compile": _sample(f"{name}-own", own_home, model, work)}
        a, b = row["carried"], row["own_compile"]
        if "png" in a and "png" in b:
            row["pixels_vs_own_compile"] = _pixels_delta(Path(a["png"]), Path(b["png"]))
        result["models"][name] = row
    try:
        result["flash"] = _check_flash(carried)
    except Exception as exc:  # the row's failure is a result too
        result["flash"] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
    result["chip"] = _chip()
    carried = prepared.get("device_fields") or {}
    result["key_fields_differ"] = {k: [carried.get(k), v] for k, v in result["chip"]["fields"].items()
                                   if carried.get(k) != v}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, default=REPO / ".tpu-aot")
    p.add_argument("--target", default="v5e")
    p.add_argument("--model-python", default=str(REPO / ".venv" / "bin" / "python"),
                   help="a Python with diffusers and torch, to write the SD 1.x folder")
    c = sub.add_parser("check")
    c.add_argument("--carried", type=Path, default=REPO / ".tpu-aot")
    c.add_argument("--out-json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    if args.command == "prepare":
        return prepare(args.out.resolve(), args.target, args.model_python)
    result = check(args.carried.resolve())
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out_json:
        args.out_json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
