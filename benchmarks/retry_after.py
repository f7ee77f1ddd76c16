"""Retry-After under a burst, against the real drain (issue 55: it said 2.7x the wait; goal <= 2x).

    PYTHONPATH=src python benchmarks/retry_after.py [MODEL] [--steps N] [--rounds R]

A server core for MODEL (default: the built-in digits model; any ``preheat.load`` source,
``random:sd1-tiny`` too) with max batch 8 and a queue of 16, warmed. Each round: a burst of
20-step requests (step reports on, as ``preheat serve`` streams them) fills the queue before any
batch of its kind has finished; the first refused one's Retry-After is read, then the seconds
until the queue has drained. Prints one JSON object: the warm-up's step cost and, per round,
said / drained and their ratio. Bounded: 8 + 16 requests a round, in this process, no network.
Timing on a shared machine is not trustworthy: run it alone.
"""

from __future__ import annotations

import argparse
import json
import time

from preheat.errors import QueueFull
from preheat.server.core import Core, CoreConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    core = Core(CoreConfig(model=args.model, max_batch_size=8, max_queue=16, batch_wait_ms=0)).start()
    try:
        assert core.wait_setup(1800) and core.setup.status == "succeeded", core.setup.logs
        out = {"model": args.model or "built-in", "steps": args.steps, "fixed_s": core.batcher.fixed_s,
               "per_step_s": core.batcher.seconds_per_step, "rounds": []}
        for r in range(args.rounds):
            core.batcher.batch_seconds.clear()  # nothing of the burst's kind has finished: the first estimate
            said = None
            for i in range(64):  # bounded: the queue refuses after the running batch and 16 waiting
                try:
                    core.submit(*core.parse({"seed": 100 * r + i, "num_inference_steps": args.steps}),
                                respond_async=True)
                except QueueFull as full:
                    said = full.retry_after
                    break
            start = time.perf_counter()
            assert core.wait_idle(1800)
            drained = time.perf_counter() - start
            out["rounds"].append({"said_s": said, "drained_s": round(drained, 3),
                                  "ratio": None if said is None else round(said / drained, 2)})
        print(json.dumps(out, indent=1))
    finally:
        core.close()


if __name__ == "__main__":
    main()
