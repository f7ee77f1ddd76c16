"""Issue 16's Ray benchmark: deploy-to-READY for the first replica (cold) and a second one (remote
warm, its own empty local root pulling from a shared-folder store), then served throughput through
Ray Serve (one replica) against ``preheat serve`` (one process) on the same machine, same options,
same load (``--requests`` one-image ``PUT /predictions/<id>`` from ``--concurrency`` httpx clients).

    PYTHONPATH=src python benchmarks/ray_serve.py [--model DIR] [--requests 256] [--concurrency 32]

The second replica is a redeploy of one replica: Serve rolls replicas on every code-based
``serve.run``, and the new one has an empty local root (``cache_home`` per replica). Prints one
JSON object. Every request must be answered 200 "succeeded" exactly once, or it fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


async def load(url: str, n: int, concurrency: int, tag: str, steps: int) -> dict[str, Any]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(i: int) -> httpx.Response:
            async with sem:
                return await client.put(f"/predictions/{tag}-{i}",
                                        json={"input": {"seed": i, "num_inference_steps": steps,
                                                              "guidance_scale": 1.0}})

        await one(-1)  # one request first: the connection pool and every layer are up
        t0 = time.perf_counter()
        responses = await asyncio.gather(*(one(i) for i in range(n)))
        took = time.perf_counter() - t0
    bad = [(r.status_code, r.text[:200]) for r in responses
           if r.status_code != 200 or r.json()["status"] != "succeeded"]
    ids = [r.json()["id"] for r in responses if r.status_code == 200]
    if bad or sorted(ids) != sorted(f"{tag}-{i}" for i in range(n)):
        raise SystemExit(f"{tag}: {len(bad)} bad answers, e.g. {bad[:3]}")
    return {"requests": n, "concurrency": concurrency, "seconds": took, "images_per_s": n / took}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    import ray
    from ray import serve

    from preheat.cache.remote import open_store
    from preheat.integrations.ray import PROXY_CALLBACK, PROXY_CALLBACK_ENV, build_app
    from preheat.server.process import ServerProcess

    tmp = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    store = tmp / "store"
    os.environ.update({"PREHEAT_CACHE_URL": str(store), "PREHEAT_TRUST_REMOTE_CACHE": "1",
                       PROXY_CALLBACK_ENV: PROXY_CALLBACK})
    options = {"model": args.model, "max_batch_size": args.max_batch_size, "guidance": "off",
               "cache_home": str(tmp / "homes" / "{replica}")}
    out: dict[str, Any] = {"options": options, "requests": args.requests, "concurrency": args.concurrency,
                           "steps": args.steps}
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8765})

        def deploy(replicas: int) -> float:
            t0 = time.perf_counter()
            serve.run(build_app({**options, "num_replicas": replicas}), name="bench", route_prefix="/")
            return time.perf_counter() - t0

        out["ready_first_cold_s"] = deploy(1)
        deadline = time.monotonic() + 300
        while not any(r.get("ok") for r in open_store(str(store)).verify("jax")) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(5)  # the rest of the background uploads (bench only; the tests wait on the store)
        # Serve gives every code-based serve.run a new version: a rolling update, whose new replica
        # (its local root empty, like one on a new node) starts from the store; the old one then stops
        out["ready_second_remote_warm_s"] = deploy(1)
        out["ray_one_replica"] = asyncio.run(load("http://127.0.0.1:8765", args.requests, args.concurrency, "ray",
                                                  args.steps))
    finally:
        serve.shutdown()
        ray.shutdown()
    # preheat serve, the same options, a root the Ray run warmed (it starts hot too)
    home = next((tmp / "homes").iterdir())
    cmd = ["--port", "0", "--host", "127.0.0.1", "--log-level", "warning", "--max-batch-size",
           str(args.max_batch_size), "--guidance", "off", *([args.model] if args.model else [])]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREHEAT_CACHE") and k != "PREHEAT_TRUST_REMOTE_CACHE"}
    server = ServerProcess(cmd, env={**env, "PREHEAT_HOME": str(home), "JAX_PLATFORMS": "cpu"})
    try:
        server.wait_port(300)
        import httpx

        deadline = time.monotonic() + 300
        while httpx.get(server.url + "/health-check").json()["status"] != "READY" and time.monotonic() < deadline:
            time.sleep(0.2)
        out["preheat_serve"] = asyncio.run(load(server.url, args.requests, args.concurrency, "serve", args.steps))
    finally:
        server.stop()
    out["ray_over_serve"] = out["ray_one_replica"]["images_per_s"] / out["preheat_serve"]["images_per_s"]
    out["load_average"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
