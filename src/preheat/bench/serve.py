"""``preheat bench serve``: load-test the server on 127.0.0.1.

1. Offline baseline, in this process: ``pipe.generate(max_batch_size)`` at the same steps,
   timed after its compile -> images/s; measured again after the load test, and the faster
   of the two is the baseline (other jobs on the machine make the speed drift).
2. ``python -m preheat.server`` in a subprocess on a free loopback port, with a random
   ``PREHEAT_API_TOKEN``; wait for READY.
3. ``concurrency`` async clients send ``n_requests`` predictions (one image each, seed i) with
   ``PUT /predictions/bench-<i>``; every request is answered once or the bench says so.
4. Check: each id got exactly one 200 "succeeded" answer with one image, and the server's own
   ``preheat_predictions_total{status="succeeded"}`` equals ``n_requests`` (no request ran twice).
5. With ``stream``: the same server takes a second load of the same size, each client POSTing
   ``/predictions`` with ``Accept: text/event-stream`` and reading the server-sent events to the
   end. A streamed request succeeded when its ``completed`` event says succeeded with one output;
   its id is the server's, so exactly-once counts completions: one ``completed`` per request, no
   id twice, and the server's succeeded counter up by ``n_requests`` again.
6. SIGTERM the server; it must exit 0.
Throughput is reported as served images/s over the offline images/s (1.0 = as fast as
batching by hand in-process at the largest batch); with ``stream``, also streamed over JSON
served images/s (``stream_ratio``), both loads on the one server process.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from preheat.server.process import ServerProcess

__all__ = ["run_bench", "markdown", "offline_throughput"]



def offline_throughput(model: Optional[str], batch: int, steps: Optional[int], min_time_s: float = 8.0,
                       max_runs: int = 200, pipe: Any = None) -> dict[str, Any]:
    """Images/s of ``pipe.generate(batch)`` in this process, after its compile. Returns the pipe too."""
    if pipe is None:
        import preheat

        pipe = preheat.load(model)
    steps = steps or int(pipe.defaults["steps"])
    from preheat.families.inputs import example_inputs

    inputs = example_inputs(pipe.family.input_specs(pipe))  # a class model: the engine's tour of its classes
    t0 = time.perf_counter()
    pipe.generate(batch, steps=steps, seed=list(range(batch)), **inputs)  # compile (or cache) + run
    first_s = time.perf_counter() - t0
    runs, start = 0, time.perf_counter()
    while runs < max_runs and (runs < 3 or time.perf_counter() - start < min_time_s):
        pipe.generate(batch, steps=steps, seed=list(range(runs * batch, (runs + 1) * batch)), **inputs)
        runs += 1
    elapsed = time.perf_counter() - start
    return {"steps": steps, "batch": batch, "runs": runs, "seconds": elapsed, "first_call_s": first_s,
            "images_per_s": runs * batch / elapsed, "sampler": pipe.defaults["sampler"],
            "num_classes": pipe.num_classes, "pipe": pipe,
            # every request's family fields, by their Cog names
            "fields": {s.surface_name: inputs[s.name] for s in pipe.family.input_specs(pipe) if s.name in inputs}}


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _body(i: int, steps: int, num_classes: Optional[int], fields: Optional[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"input": {"num_outputs": 1, "seed": i, "num_inference_steps": steps}}
    if num_classes:
        body["input"]["class_label"] = i % num_classes
    body["input"].update(fields or {})
    return body


async def _read_events(response: Any) -> list[tuple[str, str]]:
    """(event, data) of a server-sent event stream, read to its end; data lines joined by newlines."""
    events: list[tuple[str, str]] = []
    event: Optional[str] = None
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if event is not None:
                events.append((event, "\n".join(data)))
            event, data = None, []
        elif line.startswith("event:"):
            event = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].removeprefix(" "))
    if event is not None:
        events.append((event, "\n".join(data)))
    return events


async def _put_json(http: Any, i: int, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, dict[str, Any]]:
    pid = f"bench-{i}"
    r = await http.put(f"/predictions/{pid}", json=body, headers=headers)
    payload = r.json()
    return pid, {"code": r.status_code, "status": payload.get("status"), "id": payload.get("id"),
                 "outputs": len(payload.get("output") or []), "batch": payload.get("metrics", {}).get("batch_size")}


async def _post_stream(http: Any, i: int, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, dict[str, Any]]:
    async with http.stream("POST", "/predictions", json=body,
                           headers=dict(headers, Accept="text/event-stream")) as r:
        if not r.headers.get("content-type", "").startswith("text/event-stream"):
            await r.aread()
            return f"stream-{i}", {"code": r.status_code, "error": f"not an event stream: {r.text[:200]}"}
        events = await _read_events(r)
    names = [name for name, _ in events]
    completed = [json.loads(data) for name, data in events if name == "completed"]
    last = completed[-1] if completed else {}
    return f"stream-{i}", {"code": r.status_code, "status": last.get("status"), "id": last.get("id"),
                           "outputs": len(last.get("output") or []), "completed_events": len(completed),
                           "steps_logged": sum(1 for name, data in events if name == "log" and data.startswith("step ")),
                           "events": len(names), "batch": (last.get("metrics") or {}).get("batch_size")}


async def _load(base: str, token: str, n_requests: int, concurrency: int, steps: int,
                num_classes: Optional[int], deadline: float, fields: Optional[dict[str, Any]] = None,
                stream: bool = False) -> dict[str, Any]:
    """One load: ``n_requests`` from ``concurrency`` clients, JSON (``PUT /predictions/bench-<i>``)
    or streamed (``POST /predictions``, server-sent events). ``answers`` is keyed by the client's
    request (``bench-<i>`` or ``stream-<i>``), each a list of the answers it got."""
    import httpx

    key = "stream" if stream else "bench"
    answers: dict[str, list[dict[str, Any]]] = {f"{key}-{i}": [] for i in range(n_requests)}
    latencies: list[float] = []
    next_index = iter(range(n_requests))
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    send = _post_stream if stream else _put_json

    async def client(http: Any) -> None:
        for i in next_index:
            if time.monotonic() > deadline:
                return
            t0 = time.perf_counter()
            try:
                request_key, record = await send(http, i, _body(i, steps, num_classes, fields), headers)
            except Exception as err:  # noqa: BLE001 - counted as a failed request
                request_key, record = f"{key}-{i}", {"code": None, "error": f"{type(err).__name__}: {err}"}
            latencies.append(time.perf_counter() - t0)
            answers[request_key].append(record)

    timeout = max(5.0, deadline - time.monotonic())
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"answers": answers, "latencies": latencies, "wall_s": wall}


def _stream_summary(load: dict[str, Any], n_requests: int, succeeded_before: float,
                    succeeded_after: float) -> dict[str, Any]:
    """The streamed load's counts: a request succeeded when its one ``completed`` event says
    succeeded with one output; exactly once when every request did, no prediction id came back
    twice, and the server counted ``n_requests`` more successes."""
    records = [got[0] for got in load["answers"].values() if len(got) == 1]
    ok = [r for r in records if r["code"] == 200 and r.get("completed_events") == 1
          and r["status"] == "succeeded" and r["outputs"] == 1]
    ids = [r["id"] for r in ok]
    server_counted = succeeded_after - succeeded_before
    lat = load["latencies"]
    served = len(ok) / load["wall_s"] if load["wall_s"] > 0 else 0.0
    return {
        "stream_served_images_per_s": served,
        "stream_succeeded": len(ok),
        "stream_unanswered": sum(1 for got in load["answers"].values() if not got),
        "stream_distinct_ids": len(set(ids)),
        "stream_server_predictions_succeeded": server_counted,
        "stream_exactly_once": len(ok) == n_requests and len(set(ids)) == n_requests and server_counted == n_requests,
        "stream_steps_logged_min": min((r.get("steps_logged", 0) for r in ok), default=0),
        "stream_latency_p50_s": _percentile(lat, 0.5),
        "stream_latency_p99_s": _percentile(lat, 0.99),
        "stream_wall_s": load["wall_s"],
        "stream_errors": sorted({r.get("error", r.get("status")) for r in records if r not in ok}, key=str)[:5],
    }


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+\-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


# the variables that were the engine's own defaults before `preheat serve` read the table
# (preheat.load's devices and cache layers): they reach the bench's server as they reach its offline run
_ENGINE_DEFAULTS = ("devices", "cache")


def _declared_by_flags(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for the bench's server, without the deployment's ``PREHEAT_<SETTING>`` variables
    (which `preheat serve` reads where a flag is absent): the bench declares its server by its
    flags (model, batch, queue), and its requests fit that server, not one a pod's
    ``PREHEAT_SIZES`` or ``PREHEAT_MODEL`` in this shell would make."""
    from preheat.server.config import ENV_SETTINGS, env_var

    dropped = {env_var(s) for s in ENV_SETTINGS if s not in _ENGINE_DEFAULTS}
    return {k: v for k, v in env.items() if k not in dropped}


def run_bench(model: Optional[str] = None, *, n_requests: int = 256, concurrency: int = 32, max_batch_size: int = 8,
              batch_wait_ms: float = 10.0, steps: Optional[int] = None, timeout_s: float = 600.0,
              offline_s: float = 8.0, json_out: Optional[Path] = None, stream: bool = False,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    import httpx

    began = time.monotonic()
    deadline = began + timeout_s
    log(f"offline baseline: pipe.generate({max_batch_size}) in-process ...")
    offline = offline_throughput(model, max_batch_size, steps, min_time_s=offline_s)
    pipe = offline.pop("pipe")
    steps = offline["steps"]
    log(f"offline: {offline['images_per_s']:.1f} images/s ({offline['runs']} runs of {max_batch_size}, {steps} steps)")

    token = secrets.token_hex(16)
    env = dict(_declared_by_flags(os.environ), PREHEAT_API_TOKEN=token)
    args = ([model] if model else []) + ["--host", "127.0.0.1", "--port", "0", "--max-batch-size", str(max_batch_size),
                                         "--batch-wait-ms", str(batch_wait_ms), "--max-queue", str(max(64, n_requests)),
                                         "--log-level", "warning", "--grace-s", "30"]
    server = ServerProcess(args, env)
    exit_code: Optional[int] = None
    stream_load: dict[str, Any] = {}
    stream_metrics_text = ""
    try:
        port = server.wait_port(max(1.0, deadline - time.monotonic()))
        base = f"http://127.0.0.1:{port}"
        t_start = time.monotonic()
        while True:
            try:
                health = httpx.get(f"{base}/health-check", timeout=5).json()
            except httpx.HTTPError:
                health = {"status": "UNREACHABLE"}
            if health["status"] == "READY":
                break
            if health["status"] == "SETUP_FAILED" or server.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server not ready: {health}\n" + "\n".join(server.lines[-20:]))
            time.sleep(0.2)
        ready_s = time.monotonic() - t_start
        log(f"server READY after {ready_s:.1f}s; {n_requests} requests from {concurrency} clients ...")
        load = asyncio.run(_load(base, token, n_requests, concurrency, steps, offline["num_classes"], deadline,
                                 offline["fields"]))
        metrics_text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10).text
        if stream:
            log(f"streamed: {n_requests} requests from {concurrency} clients (Accept: text/event-stream) ...")
            stream_load = asyncio.run(_load(base, token, n_requests, concurrency, steps, offline["num_classes"],
                                            deadline, offline["fields"], stream=True))
            stream_metrics_text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"},
                                            timeout=10).text
    finally:
        exit_code = server.stop()
    # Again after the load, so that drift in the machine's speed (other jobs) shows up.
    offline_after = offline_throughput(model, max_batch_size, steps, min_time_s=offline_s, pipe=pipe)
    offline_after.pop("pipe")
    del pipe
    log(f"offline again: {offline_after['images_per_s']:.1f} images/s")
    offline_ips = max(offline["images_per_s"], offline_after["images_per_s"])  # the stricter baseline

    answers = load["answers"]
    ok = [pid for pid, got in answers.items()
          if len(got) == 1 and got[0]["code"] == 200 and got[0]["status"] == "succeeded" and got[0]["id"] == pid
          and got[0]["outputs"] == 1]
    unanswered = [pid for pid, got in answers.items() if not got]
    server_succeeded = _metric(metrics_text, "preheat_predictions_total", '{status="succeeded"}')
    batches = _metric(metrics_text, "preheat_batches_total")
    images = _metric(metrics_text, "preheat_batch_images_sum")
    served_ips = len(ok) / load["wall_s"] if load["wall_s"] > 0 else 0.0
    lat = load["latencies"]
    result = {
        "model": model or "built-in:digits",
        "requests": n_requests,
        "concurrency": concurrency,
        "max_batch_size": max_batch_size,
        "batch_wait_ms": batch_wait_ms,
        "steps": steps,
        "sampler": offline["sampler"],
        "offline_images_per_s": offline_ips,
        "offline_images_per_s_before": offline["images_per_s"],
        "offline_images_per_s_after": offline_after["images_per_s"],
        "served_images_per_s": served_ips,
        "throughput_ratio": served_ips / offline_ips if offline_ips else 0.0,
        "latency_p50_s": _percentile(lat, 0.5),
        "latency_p99_s": _percentile(lat, 0.99),
        "latency_max_s": max(lat) if lat else float("nan"),
        "wall_s": load["wall_s"],
        "server_ready_s": ready_s,
        "succeeded": len(ok),
        "unanswered": len(unanswered),
        "server_predictions_succeeded": server_succeeded,
        "server_batches": batches,
        "mean_batch_images": images / batches if batches else 0.0,
        "exactly_once": len(ok) == n_requests and server_succeeded == n_requests,
        "server_exit_code": exit_code,
        "stream": stream,
    }
    if stream:
        summary = _stream_summary(stream_load, n_requests, server_succeeded,
                                  _metric(stream_metrics_text, "preheat_predictions_total", '{status="succeeded"}'))
        stream_batches = _metric(stream_metrics_text, "preheat_batches_total") - batches
        stream_images = _metric(stream_metrics_text, "preheat_batch_images_sum") - images
        summary.update(stream_server_batches=stream_batches,
                       stream_mean_batch_images=stream_images / stream_batches if stream_batches else 0.0)
        result.update(summary)
        result["stream_ratio"] = (summary["stream_served_images_per_s"] / served_ips) if served_ips else 0.0
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def markdown(r: dict[str, Any]) -> str:
    rows = [
        ("requests x concurrency", f"{r['requests']} x {r['concurrency']}"),
        ("sampler / steps", f"{r['sampler']} / {r['steps']}"),
        ("max batch / batch wait", f"{r['max_batch_size']} / {r['batch_wait_ms']:g} ms"),
        ("offline (pipe.generate at max batch; best of before/after)",
         f"{r['offline_images_per_s']:.1f} img/s ({r['offline_images_per_s_before']:.1f} / "
         f"{r['offline_images_per_s_after']:.1f})"),
        ("served", f"{r['served_images_per_s']:.1f} img/s"),
        ("served / offline", f"{r['throughput_ratio']:.2f}"),
        ("latency p50 / p99 / max", f"{r['latency_p50_s'] * 1000:.0f} / {r['latency_p99_s'] * 1000:.0f} / "
                                    f"{r['latency_max_s'] * 1000:.0f} ms"),
        ("batches (mean images per batch)", f"{r['server_batches']:.0f} ({r['mean_batch_images']:.2f})"),
        ("answered exactly once", f"{'yes' if r['exactly_once'] else 'NO'} ({r['succeeded']}/{r['requests']}, "
                                  f"server counted {r['server_predictions_succeeded']:.0f})"),
        ("server READY after / exit code", f"{r['server_ready_s']:.1f} s / {r['server_exit_code']}"),
    ]
    if r.get("stream"):
        rows[6:6] = [("served, streamed (text/event-stream)", f"{r['stream_served_images_per_s']:.1f} img/s"),
                     ("streamed / JSON served", f"{r['stream_ratio']:.2f}")]
        rows += [
            ("streamed latency p50 / p99", f"{r['stream_latency_p50_s'] * 1000:.0f} / "
                                           f"{r['stream_latency_p99_s'] * 1000:.0f} ms"),
            ("streamed batches (mean images per batch)", f"{r['stream_server_batches']:.0f} "
                                                         f"({r['stream_mean_batch_images']:.2f})"),
            ("streamed answered exactly once", f"{'yes' if r['stream_exactly_once'] else 'NO'} "
                                               f"({r['stream_succeeded']}/{r['requests']}, "
                                               f"{r['stream_distinct_ids']} distinct ids, "
                                               f"server counted {r['stream_server_predictions_succeeded']:.0f})"),
        ]
    lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)
