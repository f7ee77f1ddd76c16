"""Issue 57 item 3: a cold start's stages compiled one after another (a plain load, the first call
compiles encode, denoise, decode in turn) against together (``preheat.load(prefetch=[call])``: the
rehearsed stages compile on the prefetch's threads while the weights are read). ``rehearsed``:
prefetch with ``PREHEAT_BACKGROUND_COMPILES=0``, the rehearsal's cost without the concurrency.

Each mode runs in a fresh process with an empty cache root, so nothing is served from a cache:

    python benchmarks/cold_stages.py --model random:sdxl --width 1024 --height 1024   # on the chip
    JAX_PLATFORMS=cpu python benchmarks/cold_stages.py --model PATH --steps 2         # any folder

Prints one JSON object per mode (start -> first image, the startup phases, each stage's compile
record), then a summary object (``"summary": true``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

ONE = """
    import json, sys, time
    t0 = time.perf_counter()
    import preheat
    model, mode, call = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    pipe = preheat.load(model, prefetch=None if mode == "sequential" else [call])
    pipe.generate(**call)
    wall = time.perf_counter() - t0
    keep = ("stage", "layer", "trace_lower_s", "compile_s", "background_compile", "background_compile_s", "prefetch")
    print(json.dumps({"mode": mode, "start_to_first_image_s": round(wall, 2), "startup": pipe.startup.to_dict(),
                      "stages": [{k: e.get(k) for k in keep if k in e} for e in pipe.compiler.events]}, default=str))
"""


def one(model: str, mode: str, call: dict[str, Any], home: Path) -> dict[str, Any]:
    """One cold start in a fresh process, its cache root ``home`` (empty)."""
    env = {**os.environ, "PREHEAT_HOME": str(home), "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("PREHEAT_CACHE_URL", None)  # nothing from a fleet store either
    if mode == "rehearsed":  # prefetch's rehearsal and overlap, its misses compiled on the first call in turn
        env["PREHEAT_BACKGROUND_COMPILES"] = "0"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(ONE), model, mode, json.dumps(call)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        return {"mode": mode, "error": done.stderr.strip().splitlines()[-3:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:sdxl")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--width", type=int)
    ap.add_argument("--height", type=int)
    ap.add_argument("--modes", default="sequential,together",
                    help="sequential, together, rehearsed (prefetch with PREHEAT_BACKGROUND_COMPILES=0)")
    a = ap.parse_args(argv)
    call: dict[str, Any] = {"prompt": "a fox", "steps": a.steps, "seed": 1}
    call.update({k: v for k, v in (("width", a.width), ("height", a.height)) if v})
    model = a.model
    if model.startswith("random:"):  # written once under this process's cache root, outside the empty ones
        sys.path.insert(0, str(ROOT / "src"))
        from preheat.model_source import model_root

        model = str(model_root(model))
    rows = {}
    for mode in a.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"preheat-cold-{mode}-") as home:
            rows[mode] = one(model, mode, call, Path(home))
        print(json.dumps(rows[mode]), flush=True)
    summary: dict[str, Any] = {"summary": True}
    if all("error" not in r for r in rows.values()) and {"sequential", "together"} <= rows.keys():
        s, t = rows["sequential"]["start_to_first_image_s"], rows["together"]["start_to_first_image_s"]
        summary.update(sequential_s=s, together_s=t, together_over_sequential=round(t / s, 3))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
