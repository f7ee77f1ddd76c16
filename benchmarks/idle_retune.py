"""``preheat serve --retune-idle-s`` on the CPU: request latency while the idle retune's
background compile runs, against idle, and the worker's hold per timed call (docs/benchmarks.md,
"Idle retune").

    PYTHONPATH=src:. JAX_PLATFORMS=cpu python benchmarks/idle_retune.py [ROUNDS]

The tests' tiny server model (``tests/_support/server_fixtures.write_tiny_model``) warmed once
(its entry compiled here), then per round a fresh pipeline on a copy of that root, served over
uvicorn on 127.0.0.1, requests one after another by httpx. XLA:CPU does not autotune, so the
trigger is faked as the tests fake it (``autotunes_here`` -> True, ``needs_retune`` taking the CPU
entry): the "autotuned" compile is a second compile of the same program. Nothing here measures
GPU speed or what autotuning gains.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PREHEAT_DEVICES", "1")

import httpx  # noqa: E402

import preheat  # noqa: E402
from preheat.cache import retune  # noqa: E402
from preheat.server.core import Core, CoreConfig  # noqa: E402
from tests._support.server_fixtures import serving, write_tiny_model  # noqa: E402

BODY = {"input": {"seed": 5, "class_label": 3}}


def _config(model: Path, idle_s: float | None) -> CoreConfig:
    return CoreConfig(model=str(model), max_batch_size=1, guidance=("on",), batch_wait_ms=0, retune_idle_s=idle_s)


def _latencies(client: httpx.Client, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        response = client.post("/predictions", json=BODY)
        assert response.status_code == 200, response.text
        out.append(time.perf_counter() - start)
    return out


def _round(model: Path, root: Path, results: dict[str, list[float]]) -> None:
    os.environ["PREHEAT_HOME"] = str(root)
    pipe = preheat.load(model)
    gate, finished = threading.Event(), threading.Event()
    real = pipe.compiler.compile_autotuned

    def compile_autotuned(program, args):  # held until the idle latencies are taken
        gate.wait()
        start = time.perf_counter()
        out = real(program, args)
        results["compile"].append(time.perf_counter() - start)
        finished.set()
        return out

    pipe.compiler.compile_autotuned = compile_autotuned
    core = Core(_config(model, 0.05), pipe=pipe)

    def timer(executable, args):
        seconds = retune.timed_call(executable, args)
        results["timed call"].append(seconds)
        return seconds

    core.retuner.timer = timer
    core.start()
    assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
    try:
        with serving(core) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
            _latencies(client, 5)
            results["idle"] += _latencies(client, 30)
            gate.set()
            while not finished.is_set():
                results["during compile"] += _latencies(client, 1)
            while core.retuner.busy:
                time.sleep(0.01)
    finally:
        core.close()


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    retune.autotunes_here = lambda: True
    retune.needs_retune = lambda m: m.get("autotuned") is False and "retune" not in m
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        model = write_tiny_model(base / "model")
        os.environ["PREHEAT_HOME"] = str(base / "warm")
        core = Core(_config(model, None), pipe=preheat.load(model)).start()
        assert core.wait_setup(600) and core.setup.status == "succeeded", core.setup.logs
        core.close()
        results: dict[str, list[float]] = {"idle": [], "during compile": [], "compile": [], "timed call": []}
        for i in range(rounds):
            shutil.copytree(base / "warm", base / f"round-{i}")
            _round(model, base / f"round-{i}", results)
    print("| what | n | median | p90 | max |\n|---|---|---|---|---|")
    for name, values in results.items():
        p90 = sorted(values)[int(0.9 * (len(values) - 1))]
        print(f"| {name} | {len(values)} | {statistics.median(values):.4f} s | {p90:.4f} s | {max(values):.4f} s |")


if __name__ == "__main__":
    main()
