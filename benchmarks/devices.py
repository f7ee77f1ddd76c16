"""Images/s of the built-in model split over 1, 2 and 4 forced CPU devices (issue 16).

    python benchmarks/devices.py [--rounds 3] [--runs 8] [--base SRC]

Each measurement is a fresh process with ``--xla_force_host_platform_device_count=4``: compile
once, then ``runs`` timed calls of ``generate(8, steps=20, guidance=3)``; rounds interleave the
modes so that a noisy machine hurts them alike. ``--base SRC`` adds today's single-device path
from another checkout's ``src`` (e.g. the parent commit) for the overhead at one device.

On a CPU the fake devices share the same cores, so this measures the overhead of splitting the
batch, not a speed-up; process CPU seconds per call show the work done.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MEASURE = """
import json, sys, time
import numpy as np, preheat
mode, runs = sys.argv[1], int(sys.argv[2])
options = {} if mode == "base" else {"devices": int(mode.split("/")[0]), "fsdp": int((mode + "/1").split("/")[1])}
p = preheat.load(None, cache="off", **options)
call = dict(steps=20, sampler="euler", seed=0, class_labels=list(range(8)), guidance=3.0)
p.generate(8, **call)  # compile
wall, cpu = [], []
for _ in range(runs):
    t, c = time.perf_counter(), time.process_time()
    p.generate(8, **call)
    wall.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
print(json.dumps({"mode": mode, "wall": wall, "cpu": cpu}))
"""


def measure(mode: str, runs: int, src: Path) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", MEASURE, mode, str(runs)], env=env, capture_output=True, text=True,
                         check=True, timeout=1200)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--base", type=Path, help="another checkout's src: today's single-device path")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent / "src"
    modes = (["base"] if args.base else []) + ["1", "2", "4", "4/4"]  # "4/4": 4 devices, weights split in 4
    results: dict[str, dict[str, list[float]]] = {m: {"wall": [], "cpu": []} for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            r = measure(mode, args.runs, args.base if mode == "base" else here)
            results[mode]["wall"] += r["wall"]
            results[mode]["cpu"] += r["cpu"]
    print("| devices | images/s (best) | images/s (median) | CPU s per call (median) |")
    print("|---|---|---|---|")
    for mode, r in results.items():
        wall, cpu = sorted(r["wall"]), sorted(r["cpu"])
        print(f"| {'today (' + str(args.base) + ')' if mode == 'base' else mode} | {8 / wall[0]:.1f} | "
              f"{8 / wall[len(wall) // 2]:.1f} | {cpu[len(cpu) // 2]:.2f} |")


if __name__ == "__main__":
    main()
