"""Ray Serve: ``preheat serve``'s core and routes as a Serve deployment, one replica per GPU or pod.

    serve run preheat.integrations.ray:app                       # options from PREHEAT_* (below)
    serve run preheat.integrations.ray:build_app model=/models/x max_batch_size=8 num_gpus=1
    serve run examples/ray_serve.yaml                            # autoscaling, GPUs, the fleet store
    preheat serve --ray [--address auto] MODEL ...               # the same, from the CLI

Each replica runs one :class:`~preheat.server.core.Core` (load, warm-up, the batching worker) and
serves the app :func:`preheat.server.app.create_app` builds over it, through Serve's FastAPI ingress:
the same Cog (``/predictions``, ``/health-check``) and OpenAI (``/v1/images/generations``) routes,
the same refusals, ``/metrics`` per replica. Serve routes, queues, retries a replica that refused
and autoscales; preheat makes each replica hot:

- **READY before routed.** The replica's initialisation (its constructor starts the core; Serve
  then asks it for its ASGI app) ends only when warm-up has compiled (or loaded) every program a
  request can reach, so Serve sends it no request before it is hot; a set-up failure fails the
  replica (Serve then retries it, then marks the deployment unhealthy).
- **Health** (``check_health``): healthy only while set-up succeeded, the worker thread is alive
  and the core is not closed. A full queue (``BUSY``) stays healthy: restarting a loaded replica
  would drop its queue; Serve's router already sends the next request elsewhere.
- **Graceful drain on scale-down:** Serve stops routing to the replica and waits (up to
  ``graceful_shutdown_timeout_s``) for its ongoing requests; then the replica drains its core
  (accepted predictions, including ``Prefer: respond-async`` ones, finish; up to ``grace_s``) and
  waits for its uploads to the fleet store (``push_grace_s``).
- **One cache for the fleet:** ``PREHEAT_CACHE_URL`` (with its trust and credential variables,
  :data:`FORWARDED_ENV`) is copied from the deploying process into every replica's environment
  (``runtime_env``), so a replica starting on a new node pulls the executables the first one
  compiled: its warm-up lines say ``cache: aot, remote: hit`` and it is READY without compiling.
- Every response carries ``X-Preheat-Replica`` (the Serve replica id), to tell replicas apart.

A replica whose process dies mid-request cannot answer it; Serve's proxy then has no response to
send. :func:`proxy_middlewares` (set ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` to
``preheat.integrations.ray:proxy_middlewares`` where the cluster starts) turns that into
``503`` with ``Retry-After``, which clients retry (an idempotent ``PUT /predictions/{id}`` is safe
to retry).

Options (``build_app``'s args; ``app`` reads them from the environment, as ``PREHEAT_<OPTION>``):
every deployment setting of ``preheat.settings.ENV_SETTINGS`` (``model``, default the built-in model;
``devices``: per replica, default all it was given; ...), ``grace_s``, ``push_grace_s``; deployment: ``num_replicas``
(``PREHEAT_RAY_REPLICAS``; or ``autoscaling``: ``min_replicas``/``max_replicas``/
``target_ongoing_requests``), ``num_gpus`` (per replica: 1, or a pod's count), ``num_cpus``,
``max_ongoing_requests``, ``graceful_shutdown_timeout_s``, ``cache_home`` (the replica's local
cache root; ``{replica}`` in it is replaced by the replica id, which gives replicas on one
machine separate roots as if on separate nodes; default: ``$PREHEAT_HOME`` as the node has it).
A malformed option, or one the model refuses at a replica's set-up, is one line naming it as the
user gave it (``RayOptions.names``): the arg (``inputs``), the variable (``PREHEAT_INPUTS``) or,
from ``preheat serve --ray``, the flag (``--inputs``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from ray import serve

from preheat.errors import InvalidArgumentError, PreheatError
from preheat.server.config import CoreConfig, log_to_stderr
from preheat.settings import ENV_SETTINGS, SETTINGS, typed_setting
from preheat.warm import SettingNames

__all__ = ["RayOptions", "Preheat", "build_app", "deployment", "app", "run", "health_error", "proxy_middlewares", "FORWARDED_ENV",
           "forwarded_env", "REPLICA_HEADER"]

log = logging.getLogger("preheat.server")

REPLICA_HEADER = "x-preheat-replica"

# Copied from the deploying process into every replica (runtime_env env_vars): the fleet store, its
# trust and deadline, its credentials (the standard AWS / fsspec variables) and the API token.
RAY_ENV = {"num_replicas": "PREHEAT_RAY_REPLICAS", "num_gpus": "PREHEAT_RAY_GPUS"}  # the deployment's settings
CORE_ARGS = (*ENV_SETTINGS, "push_grace_s")  # a replica's core: the deployment settings, the uploads' grace
FORWARDED_ENV = ("PREHEAT_CACHE_URL", "PREHEAT_CACHE_SIGNING_KEY", "PREHEAT_TRUST_REMOTE_CACHE",
                 "PREHEAT_CACHE_REMOTE_TIMEOUT", "PREHEAT_API_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE", "AWS_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_S3", "FSSPEC_S3_ENDPOINT_URL", "FSSPEC_S3")


def forwarded_env(env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The :data:`FORWARDED_ENV` variables set in ``env`` (default: this process's)."""
    env = os.environ if env is None else env
    return {name: env[name] for name in FORWARDED_ENV if env.get(name)}


@dataclass
class RayOptions(CoreConfig):
    """What ``build_app`` takes: a replica's core (``CoreConfig``: its deployment settings, the
    declaration's ``ENV_SETTINGS``, and ``push_grace_s``), then the replica's own and the
    deployment's. A new deployment setting is a Ray option with no line here."""

    grace_s: float = SETTINGS["grace_s"].default
    cache_home: Optional[str] = None
    num_replicas: Optional[int] = 1  # None with autoscaling
    autoscaling: Optional[dict[str, Any]] = None  # Serve's autoscaling_config
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    max_ongoing_requests: Optional[int] = None  # default: max_queue + max_batch_size
    graceful_shutdown_timeout_s: Optional[float] = None  # default: grace_s + push_grace_s + 5
    env: dict[str, str] = field(default_factory=dict)  # more replica environment (over the forwarded)
    # ``names`` (CoreConfig's): how the user named the settings a replica's set-up messages name: the
    # command line's options (``serve --ray``) unless they came as ``serve run`` args or from
    # ``PREHEAT_*`` (from_args / from_env)

    @classmethod
    def args(cls) -> tuple[str, ...]:
        """The options ``build_app`` takes: the core's of the declaration, then the rest of ours."""
        core = {f.name for f in fields(CoreConfig)}
        return (*CORE_ARGS, *(f.name for f in fields(cls) if f.name not in core))

    @classmethod
    def from_args(cls, args: Mapping[str, Any], name_of: Callable[[str], str] = str) -> "RayOptions":
        """From ``serve run ... key=value`` / a config file's ``args`` (strings or typed values);
        an unknown key or a malformed value fails in one line. ``name_of(option)``: what the user
        gave it by, which that line and the replicas' set-up messages name (the arg's own name;
        ``from_env``: its variable)."""
        known = cls.args()
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise InvalidArgumentError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(known)}")
        out: dict[str, Any] = {}
        for name, value in args.items():
            out[name] = _coerce(name, value, name_of(name))
        options = cls(**out, names=SettingNames.by(name_of))
        if options.autoscaling is not None and "num_replicas" not in args:
            options.num_replicas = None
        options.check(name_of)
        return options

    @classmethod
    def from_core(cls, config: CoreConfig, **deployment: Any) -> "RayOptions":
        """Replicas that each serve ``config``'s settings (``preheat serve --ray``), with its names for
        them; ``deployment``: the deployment's own options (``num_replicas``, ...)."""
        return cls(**{name: getattr(config, name) for name in (*CORE_ARGS, "names")}, **deployment)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "RayOptions":
        """The core's settings from ``PREHEAT_<SETTING>`` (``preheat.settings.ENV_SETTINGS``,
        as Runpod reads them), and the deployment's from ``PREHEAT_RAY_REPLICAS`` / ``PREHEAT_RAY_GPUS``."""
        from preheat.settings import env_var, settings_from_env

        env = os.environ if env is None else env
        deployment = {name: env[var] for name, var in RAY_ENV.items() if env.get(var, "").strip()}
        # one table of options from two kinds of variable: each keeps the name it was read by
        return cls.from_args({**settings_from_env(env), **deployment}, lambda name: RAY_ENV.get(name) or env_var(name))

    def check(self, name_of: Callable[[str], str] = str) -> None:
        """Each value in its range, or one line naming the first that is not as the user gave it
        (``name_of(option)``: the ``serve run`` arg, or ``from_env``'s variable)."""
        from preheat.settings import LIMITS, check_limits

        check_limits({name: getattr(self, name) for name in LIMITS}, name_of)  # the core's (lora_dir: on the replica)
        at_least = {"num_replicas": 1, "grace_s": 0, "push_grace_s": 0, "num_gpus": 0, "num_cpus": 0}
        for option, low in at_least.items():
            value = getattr(self, option)
            if value is not None and value < low:
                raise InvalidArgumentError(f"{name_of(option)} {value} must be >= {low}")
        if self.num_replicas is not None and self.autoscaling is not None:
            raise InvalidArgumentError(f"give {name_of('num_replicas')} or {name_of('autoscaling')}, not both")

    def replica_args(self) -> dict[str, Any]:
        """What a replica is constructed with: the core's options, ``grace_s`` and ``cache_home``;
        the deployment's own settings (replicas, resources) go to ``Preheat.options``, ``names``
        to the replica beside these (``deployment``)."""
        return {name: getattr(self, name) for name in (*CORE_ARGS, "grace_s", "cache_home")}

    def core_config(self) -> CoreConfig:
        """What each replica's server runs."""
        return CoreConfig(**{f.name: getattr(self, f.name) for f in fields(CoreConfig)})

    def deployment_options(self) -> dict[str, Any]:
        """``Preheat.options(...)``: replicas, resources, concurrency, the shutdown budget and the
        replica environment (the forwarded variables, then ``env``)."""
        env_vars = {**forwarded_env(), **self.env}
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                                  **({"runtime_env": {"env_vars": env_vars}} if env_vars else {})},
            # the core queues max_queue and runs max_batch_size; beyond that, Serve's router holds requests
            "max_ongoing_requests": self.max_ongoing_requests or self.max_queue + self.max_batch_size,
            "graceful_shutdown_timeout_s": (self.graceful_shutdown_timeout_s
                                            if self.graceful_shutdown_timeout_s is not None
                                            else self.grace_s + self.push_grace_s + 5.0),
        }
        if self.autoscaling is not None:
            options["autoscaling_config"] = dict(self.autoscaling)
        else:
            options["num_replicas"] = self.num_replicas
        return options


def _coerce(name: str, value: Any, label: str) -> Any:
    """A typed value for option ``name`` from a string (``serve run`` args) or a typed one: the
    core's settings as Runpod types them (``typed_setting``), then the deployment's own. A
    malformed one is one line naming ``label`` (how the user gave it)."""
    if value is None:
        return None
    if name in ENV_SETTINGS:
        return typed_setting(name, value, label)
    try:
        if name in ("max_ongoing_requests",):
            return int(value)
        if name == "num_replicas":
            return None if value in (None, "auto") else int(value)
        if name in ("grace_s", "push_grace_s", "num_gpus", "num_cpus", "graceful_shutdown_timeout_s"):
            return float(value)
        if name in ("autoscaling", "env"):
            if isinstance(value, str):
                import json

                value = json.loads(value)
            if not isinstance(value, dict):
                raise ValueError("a mapping")
            return {str(k): (str(v) if name == "env" else v) for k, v in value.items()}
    except PreheatError:
        raise
    except (TypeError, ValueError) as err:
        raise InvalidArgumentError(f"{'option ' if label == name else ''}{label}={value!r}: {err}") from None
    return str(value)


def health_error(core: Any) -> Optional[str]:
    """Why ``core``'s replica is unhealthy, or None: set-up has not succeeded, the worker thread
    died, or the core was closed. A full queue (BUSY) is healthy."""
    if core.setup.status != "succeeded":
        return f"set-up {core.setup.status}" + (f": {core.setup.error}" if core.setup.error else "")
    thread = getattr(core, "_thread", None)
    if thread is None or not thread.is_alive():
        return "the batching worker is not running"
    return None


class _ReplicaHeader:
    """ASGI: every HTTP response says which replica answered (``X-Preheat-Replica``)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)]}
            await send(message)

        await self.app(scope, receive, send_tagged)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (a test constructing the class directly)
        return f"pid{os.getpid()}"


@serve.deployment(name="Preheat")
@serve.ingress()
class Preheat:
    """One replica: a core started by the constructor, and preheat's app over it once READY."""

    def __init__(self, options: dict[str, Any], names: SettingNames) -> None:
        from preheat.server.core import Core

        log_to_stderr("info")
        self.options = replace(RayOptions.from_args(options), names=names)  # set-up errors name them so
        self.replica = _replica_id()
        if self.options.cache_home:
            os.environ["PREHEAT_HOME"] = self.options.cache_home.replace("{replica}", self.replica)
        self.core = Core(self.options.core_config()).start()

    async def __serve_build_asgi_app__(self) -> Any:
        """Called by Serve after the constructor: wait for warm-up (Serve routes nothing here
        until this returns), then the same app ``preheat serve`` runs."""
        from preheat.server.app import create_app

        await asyncio.to_thread(self.core.wait_setup)
        if self.core.setup.status != "succeeded":
            raise RuntimeError(f"preheat set-up failed: {self.core.setup.error}")
        log.info("replica %s READY", self.replica)
        app = create_app(self.core, token=os.environ.get("PREHEAT_API_TOKEN") or None, grace_s=self.options.grace_s)
        return _ReplicaHeader(app, self.replica)

    def check_health(self) -> None:
        why = health_error(self.core)
        if why is not None:
            raise RuntimeError(f"preheat replica unhealthy: {why}")

    async def __del__(self) -> None:
        """Scale-down: Serve has already drained its ongoing requests; finish what the core still
        holds (async predictions), then the uploads to the fleet store."""
        core = getattr(self, "core", None)
        if core is None:
            return
        core.begin_drain()
        if not await asyncio.to_thread(core.wait_idle, self.options.grace_s):
            log.warning("replica %s: grace period over; failing the predictions still waiting", self.replica)
        await asyncio.to_thread(core.close, 1.0)


def deployment(options: RayOptions) -> Any:
    """The Serve application of ``options``: its deployment's settings, and each replica's with
    how the user named them (``options.names``, which its set-up messages say)."""
    return Preheat.options(**options.deployment_options()).bind(options.replica_args(), options.names)


def build_app(args: Mapping[str, Any]) -> Any:
    """Serve's application builder (``serve run preheat.integrations.ray:build_app key=value ...``)."""
    return deployment(RayOptions.from_args(dict(args)))


def proxy_middlewares() -> list[Any]:
    """For ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``: Serve's proxies answer ``503`` with
    ``Retry-After`` (instead of an empty 500) when the replica handling a request died before
    answering, so that clients know to retry."""
    from starlette.middleware import Middleware

    return [Middleware(RetryWhenLost)]


class RetryWhenLost:
    """ASGI middleware: a request the app returned from without a whole response (Serve's proxy
    does this when the replica died) gets ``503`` with ``Retry-After: 1``.

    A response of known length is held until its last byte, so that a replica dying between the
    headers and the body still gives a clean 503 rather than a cut connection; a streamed one
    (no ``content-length``) passes through as it comes."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: list[dict] = []  # a sized response's messages, until its body is complete
        streaming = complete = False

        async def watch(message: dict) -> None:
            nonlocal streaming, complete
            if message["type"] == "http.response.start":
                streaming = not any(name.lower() == b"content-length" for name, _ in message.get("headers", ()))
            if streaming:
                await send(message)
                return
            held.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
                for m in held:
                    await send(m)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if streaming or complete:
                raise
        if not (streaming or complete):
            body = b'{"detail": "the replica serving this request went away; retry"}'
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "preheat.integrations.ray:proxy_middlewares"


def run(options: RayOptions, *, address: Optional[str] = None, host: str = "127.0.0.1", port: int = 8000,
        name: str = "preheat", announce: Any = print) -> int:
    """``preheat serve --ray``: deploy on the cluster at ``address`` (None: start a local one on
    this machine, on loopback unless ``host`` says otherwise), return once every replica is READY
    after ``announce``-ing the URL, block until SIGINT/SIGTERM, then delete the application
    (replicas drain: in-flight requests finish) and return 0."""
    import signal
    import threading

    import ray

    options.check()
    if address is None:
        os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)  # read by the proxies this cluster starts
        loopback = host in ("127.0.0.1", "localhost")
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1" if loopback else None)
    else:
        ray.init(address=address)
        if os.environ.get(PROXY_CALLBACK_ENV) != PROXY_CALLBACK:
            announce(f"note: a request whose replica dies gets an empty 500 unless the cluster was started with "
                     f"{PROXY_CALLBACK_ENV}={PROXY_CALLBACK}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        t0 = time.perf_counter()
        serve.start(http_options={"host": host, "port": port})
        serve.run(deployment(options), name=name, route_prefix="/", blocking=False)
        announce(f"preheat serve --ray: READY on http://{host}:{port} after {time.perf_counter() - t0:.1f}s "
                 f"({options.num_replicas or 'autoscaled'} replica(s)); Ctrl-C drains and stops")
        stop.wait()
        announce("preheat serve --ray: draining")
        serve.delete(name)
    finally:
        if address is None:
            serve.shutdown()
        ray.shutdown()
    return 0


if TYPE_CHECKING:  # for readers and checkers: ``app`` is a name of this module, made by __getattr__
    app: Any


def __getattr__(name: str) -> Any:
    """``app``: the application built from ``PREHEAT_*`` (:meth:`RayOptions.from_env`) when first
    asked for (``serve run preheat.integrations.ray:app``), not at import (replicas import this
    module too)."""
    if name == "app":
        return deployment(RayOptions.from_env())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
