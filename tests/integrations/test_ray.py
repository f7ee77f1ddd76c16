"""Ray Serve: a real local Ray cluster on 127.0.0.1 (started here, shut down at the end even on
failure), preheat's deployment with the tiny class-conditional model on the CPU, and a real S3
store (moto's server on loopback) shared by the replicas.

Each replica gets its own local cache root (``cache_home`` with ``{replica}``), as replicas on
separate nodes would have: what one compiles reaches another only through the store.

Serve gives every code-based ``serve.run`` a new deployment version, so each redeploy (here:
each change of replica count) is a rolling update: new replicas start, the old ones are stopped
gracefully. After the first, cold, replica every replica therefore starts from the store.

One module-scoped cluster and one application; each test asks for the replica count it needs
(:func:`scale`), so no test depends on another having run. Marked ``ray``: skip with
``-m "not ray"``. Runtime: about 1-2 minutes on 2 cores, most of it Ray's start and the first
replica's compile.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from tests._support.s3_server import free_port, s3_server  # noqa: E402
from tests._support.server_fixtures import wait_until  # noqa: E402

pytestmark = pytest.mark.ray

SIGNING_KEY = "ray-fleet-" + "0123456789abcdef" * 2
APP = "preheat"
OPTIONS = {"max_batch_size": 4, "batch_wait_ms": 20, "guidance": "off", "num_cpus": 0.5, "grace_s": 60,
           "push_grace_s": 30}


class Cluster:
    def __init__(self, url: str, model: Path, homes: Path, store_url: str) -> None:
        self.url, self.model, self.homes, self.store_url = url, model, homes, store_url
        self.ready_s: dict[str, float] = {}

    def deploy(self, replicas: int) -> float:
        """``serve.run`` with ``replicas`` replicas (only the count changes: Serve scales in place);
        returns the seconds until every replica is READY (serve.run returns then)."""
        from preheat.integrations.ray import build_app

        t0 = time.perf_counter()
        serve.run(build_app({**OPTIONS, "model": str(self.model), "num_replicas": replicas,
                             "cache_home": str(self.homes / "{replica}")}),
                  name=APP, route_prefix="/", blocking=False)
        wait_until(lambda: len(running_replicas()) == replicas, timeout=240, what=f"{replicas} running replicas")
        return time.perf_counter() - t0


def running_replicas() -> list[str]:
    status = serve.status().applications.get(APP)
    if status is None or status.status != "RUNNING":
        return []
    deployment = status.deployments["Preheat"]
    return ["x"] * deployment.replica_states.get("RUNNING", 0)


def replica_ids() -> list[str]:
    """The replica actors named now (Serve names them SERVE_REPLICA::<app>#<deployment>#<id>)."""
    from ray.util import list_named_actors

    names = [a["name"] for a in list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    return sorted(n.rsplit("#", 1)[1] for n in names if n.startswith(f"SERVE_REPLICA::{APP}#Preheat#"))


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, session_cache_root: None):
    tmp = tmp_path_factory.mktemp("ray")
    with s3_server() as s3:
        bucket = s3.new_bucket()
        saved = dict(os.environ)
        # Serve's proxies answer 503 + Retry-After for a request whose replica died (read where they start)
        os.environ["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] = "preheat.integrations.ray:proxy_middlewares"
        # Ray's session folder holds its AF_UNIX sockets (at most 107 bytes of path): a short folder
        # of its own, not under pytest's (long, per-worker) basetemp
        ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 _temp_dir=ray_dir)
        try:
            # Set after ray.init: the replicas get these only through the deployment's runtime_env.
            os.environ.update({**s3.env(), "PREHEAT_CACHE_URL": f"s3://{bucket}/fleet",
                               "PREHEAT_CACHE_SIGNING_KEY": SIGNING_KEY})
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            c = Cluster(f"http://127.0.0.1:{port}", model_dir, tmp / "homes", os.environ["PREHEAT_CACHE_URL"])
            c.ready_s["first (cold)"] = c.deploy(1)
            c.first = health_by_replica(c, 1)
            wait_until(lambda: _store_entries(c) >= 2, timeout=120, what="the first replica's uploads")
            c.ready_s["second (remote warm)"] = c.deploy(1)  # a new replica, its local root empty
            c.second = health_by_replica(c, 1, exclude=set(c.first))
            print(f"\nray: READY after {c.ready_s}")
            yield c
        finally:
            os.environ.clear()
            os.environ.update(saved)
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                shutil.rmtree(ray_dir, ignore_errors=True)


def _store_entries(c: Cluster) -> int:
    """Entries the store holds (each pushed after its manifest verified)."""
    from preheat.cache.remote import open_store

    store = open_store(c.store_url, signing_key=SIGNING_KEY.encode(), timeout=5.0)
    return sum(1 for row in store.verify("jax") if row.get("ok"))


def scale(c: Cluster, replicas: int) -> None:
    if len(running_replicas()) != replicas:
        c.deploy(replicas)


def health_by_replica(c: Cluster, count: int, exclude: set[str] = frozenset()) -> dict[str, dict]:
    """``/health-check`` of ``count`` replicas other than ``exclude`` (the ``X-Preheat-Replica``
    header says which answered), in bursts of concurrent calls: Serve's router sends a lone request
    to the same idle replica each time, but spreads requests that overlap."""
    seen: dict[str, dict] = {}

    async def burst() -> None:
        async with httpx.AsyncClient(base_url=c.url, timeout=30, limits=httpx.Limits(max_connections=16)) as client:
            for r in await asyncio.gather(*(client.get("/health-check") for _ in range(16))):
                if r.headers["x-preheat-replica"] not in exclude:
                    seen[r.headers["x-preheat-replica"]] = r.json()

    def poll() -> bool:
        asyncio.run(burst())
        return len(seen) >= count

    try:
        # a replica Serve starts in place of a killed one imports JAX, loads and warms before it is
        # routable: on 2 busy cores (the other test worker compiling) that took over 60 s once
        wait_until(poll, timeout=240, what=f"health-checks from {count} replica(s)")
    except AssertionError as err:
        raise AssertionError(f"{err}; answered: {sorted(seen)}; named: {replica_ids()}") from None
    return seen


def body(seed: int, **extra: Any) -> dict:
    # guidance_scale 1: the warmed program (OPTIONS warm guidance off only, to keep warm-up short)
    return {"input": {"seed": seed, "class_label": seed % 10, "num_inference_steps": 2, "guidance_scale": 1, **extra}}


async def _post_all(c: Cluster, bodies: list[dict], started: Any = None) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=c.url, timeout=180, limits=limits) as client:
        tasks = [asyncio.create_task(client.put(f"/predictions/{b['id']}", json=b)) for b in bodies]
        if started is not None:
            await started(tasks)
        return list(await asyncio.gather(*tasks))


def test_second_replica_starts_from_the_store_with_an_aot_remote_hit(cluster: Cluster) -> None:
    """The replicas' /health-check, taken when each became READY (the fixture)."""
    ((_, first),), ((_, second),) = cluster.first.items(), cluster.second.items()
    assert first["status"] == second["status"] == "READY"
    warm = [line for line in second["setup"]["logs"].splitlines() if line.startswith("warm-up:")]
    assert warm and all("(cache: aot, remote: hit)" in line for line in warm), warm
    compiled = [line for line in first["setup"]["logs"].splitlines() if line.startswith("warm-up:")]
    assert len(compiled) == len(warm) and not any("cache: aot" in line for line in compiled), compiled


def test_a_replica_set_up_error_names_the_setting_as_the_deployment_was_given_it(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve run preheat.integrations.ray:app`` reads ``PREHEAT_*``; ``build_app`` takes ``key=value``
    args: the replica's set-up error (Serve fails the deployment with it, after 3 tries) names what
    the user set, never the command line's ``--inputs``. Bounded: the model loads, nothing
    compiles, and the two deployments fail side by side."""
    import concurrent.futures

    import preheat.integrations.ray as on_ray

    settings = {"model": str(cluster.model), "inputs": "negative_prompt", "max_batch_size": "1", "guidance": "off",
                "cache": "off"}
    for name, value in settings.items():
        monkeypatch.setenv(f"PREHEAT_{name.upper()}", value)
    apps = {"bad-env": on_ray.app, "bad-args": on_ray.build_app({**settings, "num_cpus": 0.5})}
    why: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(len(apps)) as pool:
        deploying = {name: pool.submit(serve.run, app, name=name, route_prefix=f"/{name}", blocking=False)
                     for name, app in apps.items()}
        try:
            for name, future in deploying.items():
                with pytest.raises(RuntimeError, match=f"Deploying application {name} failed"):
                    future.result(timeout=300)
                why[name] = serve.status().applications[name].deployments["Preheat"].message  # the replica's traceback
        finally:
            for name in apps:
                serve.delete(name)
    for name, given in (("bad-env", "PREHEAT_INPUTS"), ("bad-args", "inputs")):
        error = (f"preheat set-up failed: {given} 'negative_prompt' is not an optional input of a pixel model: it has "
                 f"no optional inputs (give none, or leave {given} out)")
        assert why[name].rstrip().endswith(error) and "--inputs" not in why[name], why[name][-2000:]


def test_64_concurrent_requests_each_answered_exactly_once(cluster: Cluster) -> None:
    scale(cluster, 2)
    health_by_replica(cluster, 2)  # both replicas routable (after a kill, Serve replaces one first)
    bodies = [{**body(i % 32), "id": f"c64-{i}"} for i in range(64)]
    responses = asyncio.run(_post_all(cluster, bodies))
    assert [r.status_code for r in responses] == [200] * 64, [r.text[:200] for r in responses if r.status_code != 200]
    snaps = [r.json() for r in responses]
    assert [s["id"] for s in snaps] == [b["id"] for b in bodies]  # each request got its own answer
    assert all(s["status"] == "succeeded" and len(s["output"]) == 1 for s in snaps)
    assert not any(s["metrics"]["compiled"] for s in snaps)  # hot replicas: traffic never compiles
    replicas = {r.headers["x-preheat-replica"] for r in responses}
    assert len(replicas) == 2, replicas  # both replicas served
    # requests i and i+32 ask for the same image: the same pixels whichever replica drew them
    import numpy as np
    from PIL import Image

    def pixels(snap: dict) -> Any:
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(snap["output"][0].partition(",")[2]))))

    for i in range(32):
        np.testing.assert_array_equal(pixels(snaps[i]), pixels(snaps[i + 32]))


def test_stopped_replicas_let_in_flight_requests_finish(cluster: Cluster) -> None:
    """2 -> 1 replicas under load (a rolling update: both old replicas are stopped, as on a
    scale-down): every accepted request is answered."""
    scale(cluster, 2)
    bodies = [{**body(100 + i, num_inference_steps=8), "id": f"drain-{time.monotonic_ns()}-{i}"} for i in range(24)]

    async def shrink(tasks: list) -> None:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # load flows; the rest is in flight
        await asyncio.to_thread(cluster.deploy, 1)

    before = set(replica_ids())
    responses = asyncio.run(_post_all(cluster, bodies, started=shrink))
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text[:200] for r in responses]
    # the rolling update stops every old replica: the requests they held were answered, not dropped
    wait_until(lambda: not before & set(replica_ids()), timeout=120, what="the old replicas to stop")
    assert {r.headers["x-preheat-replica"] for r in responses} & before, before


def test_killing_a_replica_mid_load_loses_no_accepted_request(cluster: Cluster) -> None:
    """Every request is answered: 200, or 503 with Retry-After for the ones the dead replica held
    (see preheat.integrations.ray.proxy_middlewares); a retry of those succeeds."""
    scale(cluster, 2)
    victim: list[str] = []
    bodies = [{**body(200 + i, num_inference_steps=8), "id": f"kill-{time.monotonic_ns()}-{i}"} for i in range(32)]

    async def kill_when_loaded(tasks: list) -> None:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # load flows; the rest in flight
        victim.append(next(iter(done)).result().headers["x-preheat-replica"])  # alive, and loaded
        actor = ray.get_actor(f"SERVE_REPLICA::{APP}#Preheat#{victim[0]}", namespace="serve")
        ray.kill(actor, no_restart=True)

    responses = asyncio.run(_post_all(cluster, bodies, started=kill_when_loaded))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, [(r.status_code, r.text[:200]) for r in responses]
    lost = [b for b, r in zip(bodies, responses) if r.status_code == 503]
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 503)
    print(f"\nray kill: {codes.count(200)} answered, {len(lost)} retriable 503")
    if lost:
        retried = asyncio.run(_post_all(cluster, lost))
        assert [r.status_code for r in retried] == [200] * len(lost)


# ---------------------------------------------------------------- no cluster needed


def test_a_replica_lost_between_headers_and_body_still_gets_a_clean_503() -> None:
    """The proxy middleware holds a sized response until its last byte: a replica that died after
    the headers (the cut connection seen under load) or before them both give 503 + Retry-After;
    whole and streamed responses pass through unchanged."""
    from preheat.integrations.ray import RetryWhenLost

    def app(kind: str) -> Any:
        async def asgi(scope: dict, receive: Any, send: Any) -> None:
            sized = [(b"content-length", b"5")] if kind != "streamed" else []
            if kind == "lost before headers":
                return
            await send({"type": "http.response.start", "status": 200, "headers": sized})
            if kind == "lost after headers":
                return
            if kind == "raised after headers":
                raise RuntimeError("replica actor died")
            await send({"type": "http.response.body", "body": b"he", "more_body": True})
            await send({"type": "http.response.body", "body": b"llo"})
        return asgi

    async def get(kind: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=RetryWhenLost(app(kind)))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/")

    for kind in ("lost before headers", "lost after headers", "raised after headers"):
        r = asyncio.run(get(kind))
        assert (r.status_code, r.headers["retry-after"]) == (503, "1"), kind
        assert "went away" in r.json()["detail"], kind
    for kind in ("whole", "streamed"):
        r = asyncio.run(get(kind))
        assert (r.status_code, r.content) == (200, b"hello"), kind


def test_options_from_serve_run_args_and_one_line_errors() -> None:
    from preheat.errors import InvalidArgumentError
    from preheat.integrations.ray import RayOptions

    o = RayOptions.from_args({"max_batch_size": "4", "sizes": "32x16", "devices": "2", "num_gpus": "1",
                              "autoscaling": '{"min_replicas": 1, "max_replicas": 4}'})
    assert (o.max_batch_size, o.sizes, o.devices, o.num_replicas) == (4, ((32, 16),), 2, None)
    d = o.deployment_options()
    assert d["ray_actor_options"]["num_gpus"] == 1.0 and d["autoscaling_config"]["max_replicas"] == 4
    assert "num_replicas" not in d and d["max_ongoing_requests"] == 64 + 4
    e = RayOptions.from_env({"PREHEAT_MODEL": "/m", "PREHEAT_MAX_BATCH_SIZE": "2", "PREHEAT_RAY_REPLICAS": "3",
                             "PREHEAT_RAY_GPUS": "8", "PREHEAT_GUIDANCE": "off"})
    assert (e.model, e.max_batch_size, e.num_replicas, e.num_gpus, e.guidance) == ("/m", 2, 3, 8.0, ("off",))
    f = RayOptions.from_env({"PREHEAT_FSDP": "2", "PREHEAT_LORA_RANKS": "16,32", "PREHEAT_MAX_LORAS": "3"})
    config = f.core_config()  # what each replica's server runs: the same declaration as serve/warm
    assert (config.fsdp, config.lora_ranks, config.max_loras) == (2, (16, 32), 3)
    g = RayOptions.from_env({"PREHEAT_MODEL": "/m.safetensors", "PREHEAT_CONFIG": "/folder", "PREHEAT_PROGRESS": "off",
                             "PREHEAT_VARIANT": "fp16", "PREHEAT_WEIGHTS_DTYPE": "float8_e4m3fn"}).core_config()
    assert (g.config, g.progress, g.variant, g.weights_dtype) == ("/folder", False, "fp16", "float8_e4m3fn")
    assert RayOptions.from_args({"progress": "1"}).progress is True and RayOptions().progress is True
    with pytest.raises(InvalidArgumentError, match="progress 'maybe' must be on or off"):
        RayOptions.from_args({"progress": "maybe"})
    with pytest.raises(InvalidArgumentError, match="unknown option.*max_batch"):
        RayOptions.from_args({"max_batch": 4})
    with pytest.raises(InvalidArgumentError, match="max_batch_size 'x' must be an int"):
        RayOptions.from_args({"max_batch_size": "x"})
    # a malformed value names what the user set: the serve run arg, or the variable app read it from
    with pytest.raises(InvalidArgumentError, match="^PREHEAT_MAX_BATCH_SIZE 'x' must be an int$"):
        RayOptions.from_env({"PREHEAT_MAX_BATCH_SIZE": "x"})
    with pytest.raises(InvalidArgumentError, match="^PREHEAT_RAY_REPLICAS='x': invalid literal"):
        RayOptions.from_env({"PREHEAT_RAY_REPLICAS": "x"})
    # and so does a value out of range: the one that is, with its value
    with pytest.raises(InvalidArgumentError, match="^PREHEAT_MAX_QUEUE 0 must be >= 1$"):
        RayOptions.from_env({"PREHEAT_MAX_QUEUE": "0"})
    with pytest.raises(InvalidArgumentError, match="^PREHEAT_RAY_GPUS -1.0 must be >= 0$"):
        RayOptions.from_env({"PREHEAT_RAY_GPUS": "-1"})
    with pytest.raises(InvalidArgumentError, match="^push_grace_s -1.0 must be >= 0$"):
        RayOptions.from_args({"push_grace_s": "-1"})
    with pytest.raises(InvalidArgumentError, match="^give num_replicas or autoscaling, not both$"):
        RayOptions.from_args({"num_replicas": "2", "autoscaling": '{"min_replicas": 1}'})
    from preheat.warm import SettingNames

    # what each replica's set-up messages name (serve --ray builds RayOptions from its flags: the defaults)
    assert RayOptions().core_config().names == SettingNames() == SettingNames.by(lambda s: "--" + s.replace("_", "-"))
    assert RayOptions.from_args({}).core_config().names == SettingNames.by(str)
    assert e.core_config().names == SettingNames.by(lambda s: "PREHEAT_" + s.upper())
    assert e.core_config().names[:3] == ("PREHEAT_INPUTS", "PREHEAT_SIZES", "PREHEAT_MAX_STEPS")
    with pytest.raises(InvalidArgumentError, match="^PREHEAT_MAX_LORAS 0 must be >= 1$"):  # the core's table
        RayOptions.from_env({"PREHEAT_MAX_LORAS": "0"})


def test_the_fleet_store_and_its_credentials_reach_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    from preheat.integrations.ray import RayOptions

    monkeypatch.setenv("PREHEAT_CACHE_URL", "s3://b/p")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    env = RayOptions().deployment_options()["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env["PREHEAT_CACHE_URL"] == "s3://b/p" and env["AWS_SECRET_ACCESS_KEY"] == "s"
    assert "UNRELATED_SECRET" not in env


def test_health_is_false_until_set_up_succeeded_and_while_the_worker_is_dead(pipe: Any) -> None:
    from preheat.integrations.ray import health_error
    from preheat.server.core import Core, CoreConfig

    def fail(config: Any) -> Any:
        raise RuntimeError("no weights")

    failed = Core(CoreConfig(max_batch_size=1), loader=fail).start()
    assert failed.wait_setup(60)
    assert "set-up failed" in health_error(failed)
    core = Core(CoreConfig(max_batch_size=1, guidance=("off",)), pipe=pipe)
    assert "set-up starting" == health_error(core)
    core.start()
    assert core.wait_setup(120) and health_error(core) is None
    core.close()
    assert health_error(core) == "the batching worker is not running"


def test_example_serve_config_is_valid_and_builds() -> None:
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from preheat.integrations.ray import build_app

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "ray_serve.yaml").read_text())
    config = ServeDeploySchema.model_validate(raw)
    app = config.applications[0]
    assert app.import_path == "preheat.integrations.ray:build_app"
    assert app.deployments[0].autoscaling_config["max_replicas"] >= app.deployments[0].autoscaling_config["min_replicas"]
    assert "PREHEAT_CACHE_URL" in app.runtime_env["env_vars"]
    build_app(app.args)  # every arg is an option
