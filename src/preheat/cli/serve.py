"""`preheat serve`: the HTTP server's options, checked in one line before anything loads.

Importing this module is cheap (no JAX, FastAPI or uvicorn until a command runs).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional

import click

from preheat.cli._support import one_line_errors
from preheat.cli.settings_env import SettingsCommand, flag_of, names_of
from preheat.cli.warm import declaration_options, warm_set_from_options

__all__ = ["serve_command"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _setup_logging(level: str) -> None:
    logger = logging.getLogger("preheat.server")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s preheat: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def _check_backend(backend: str) -> None:
    from preheat.errors import InvalidArgumentError

    if backend == "jax":
        return
    try:
        from preheat.backends.torch import load_torch_pipeline

        del load_torch_pipeline  # imported to refuse before serving, not at set-up
    except ImportError as err:
        raise InvalidArgumentError(f"--backend torch needs the torch extra: {err}") from None


def _check_http_limits(grace_s: float, header_timeout_s: float = 10.0, body_timeout_s: float = 30.0,
                       max_body_bytes: int = 1 << 20) -> None:
    """The HTTP server's own limits (the core's: ``preheat.server.config.check_limits``); a bad one
    fails in one line naming its flag."""
    from preheat.errors import InvalidArgumentError

    if grace_s < 0:
        raise InvalidArgumentError(f"--grace-s {grace_s} must be >= 0")
    if header_timeout_s <= 0:
        raise InvalidArgumentError(f"--header-timeout-s {header_timeout_s} must be > 0")
    if body_timeout_s <= 0:
        raise InvalidArgumentError(f"--body-timeout-s {body_timeout_s} must be > 0")
    if max_body_bytes < 1:
        raise InvalidArgumentError(f"--max-body-bytes {max_body_bytes} must be >= 1")


def _check_models(warm_set: Any, name_of: Any = flag_of) -> None:
    """MODEL and the second model folders are there (``preheat.model_source.check_model``), or one
    line naming the one that is not: before any port is bound, JAX imported or weight read."""
    from preheat.errors import PreheatError
    from preheat.model_source import check_model

    check_model(warm_set.model)
    for name in ("controlnet", "refiner"):
        try:
            check_model(getattr(warm_set, name))
        except PreheatError as err:
            raise type(err)(f"{name_of(name)}: {err}") from None


def _fetch_config(connect_timeout_s: float, deadline_s: float, max_lora_bytes: int, max_image_bytes: int,
                  per_host: int, max_fetches: int) -> Any:
    """The fetch limits; a bad one fails in one line naming its flag."""
    from preheat.errors import InvalidArgumentError
    from preheat.server.fetch import FetchConfig

    flags = {"connect_timeout_s": "--fetch-connect-timeout-s", "deadline_s": "--fetch-deadline-s",
             "max_lora_bytes": "--max-lora-bytes", "max_image_bytes": "--max-image-bytes",
             "per_host": "--fetch-per-host", "max_fetches": "--max-fetches"}
    try:
        return FetchConfig(connect_timeout_s=connect_timeout_s, deadline_s=deadline_s, max_lora_bytes=max_lora_bytes,
                           max_image_bytes=max_image_bytes, per_host=per_host, max_fetches=max_fetches)
    except InvalidArgumentError as err:
        flag = flags.get(err.argument or "", err.argument)
        raise InvalidArgumentError(f"{flag} {str(err).split(' ', 1)[1]}", argument=err.argument) from None


def _address_policy(allow_private: bool, allow: tuple[str, ...], flag: str = "--webhook-allow") -> Any:
    """The address policy of webhooks or of requests' LoRA URLs; a bad CIDR names ``flag``."""
    from preheat.errors import InvalidArgumentError
    from preheat.server.webhooks import WebhookPolicy, WebhookRefused

    try:
        return WebhookPolicy(allow_private=allow_private, allow=tuple(allow))
    except WebhookRefused as err:
        raise InvalidArgumentError(f"{flag}: {err}") from None


@click.command("serve", cls=SettingsCommand)
@declaration_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (loopback unless told).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port (0 = any free port, printed at start).")
@click.option("--backend", default="jax", show_default=True, type=click.Choice(["jax", "torch"]))
@click.option("--compile", "compile_mode", default="none", show_default=True,
              type=click.Choice(["none", "inductor", "aot", "regional"]),
              help="--backend torch: eager, torch.compile, AOTInductor or regional (the repeated blocks).")
@click.option("--batch-wait-ms", default=10.0, show_default=True, type=float,
              help="How long the oldest request waits for others to share its batch.")
@click.option("--max-queue", default=64, show_default=True, type=int,
              help="Predictions allowed to wait; beyond it, 409 (Cog) / 429 (OpenAI) with Retry-After.")
@click.option("--max-steps", default=200, show_default=True, type=int, help="Largest num_inference_steps accepted.")
@click.option("--max-loras", default=8, show_default=True, type=int,
              help="LoRAs held ready (read, factors on the device), least recently used out; see /metrics.")
@click.option("--lora-dir", type=click.Path(file_okay=False, exists=True), metavar="DIR",
              help="Requests may name local LoRA files (lora_weights) under DIR only; without it, only "
                   "http(s):// and hf:// sources.")
@click.option("--grace-s", default=30.0, show_default=True, type=float,
              help="On SIGTERM, how long in-flight predictions may take to finish.")
@click.option("--push-grace-s", default=30.0, show_default=True, type=float,
              help="At shutdown, how long uploads to PREHEAT_CACHE_URL (run in the background) may take.")
@click.option("--retune-idle-s", "retune_idle_s_text", default="30", show_default=True, metavar="SECONDS|off",
              help="On a GPU: after this long without a request, executables served from entries compiled without "
                   "autotuning (warm --target) are compiled again, autotuned, in the background, timed against the "
                   "served ones between requests, and swapped in (and their entries replaced) when faster. "
                   "0 or off: never.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=int,
              help="Largest request body (any transfer encoding); beyond it, 413.")
@click.option("--header-timeout-s", default=10.0, show_default=True, type=float,
              help="A request's headers must arrive within this; else the connection is closed.")
@click.option("--body-timeout-s", default=30.0, show_default=True, type=float,
              help="A request's body must arrive within this; else 408.")
@click.option("--webhook-allow-private", is_flag=True,
              help="Let webhooks go to loopback/private/link-local addresses (never metadata ones).")
@click.option("--webhook-allow", "webhook_allow", multiple=True, metavar="HOST|CIDR",
              help="Let webhooks go to this host, address or CIDR whatever it is (repeat).")
@click.option("--lora-url-allow-private", is_flag=True,
              help="Let requests' LoRA and image URLs be fetched from loopback/private/link-local addresses (never "
                   "metadata ones).")
@click.option("--lora-url-allow", "lora_url_allow", multiple=True, metavar="HOST|CIDR",
              help="Let requests' LoRA and image URLs be fetched from this host, address or CIDR whatever it is "
                   "(repeat).")
@click.option("--keep-alive-on-failure", is_flag=True,
              help="If the model cannot be set up, stay up answering SETUP_FAILED on /health-check (as Cog does) "
                   "instead of exiting 1.")
@click.option("--fetch-connect-timeout-s", default=10.0, show_default=True, type=float,
              help="A URL a request names (lora_weights): its host must accept the connection within this.")
@click.option("--fetch-deadline-s", default=120.0, show_default=True, type=float,
              help="... and the whole download (waiting for a fetch slot included) must end within this; else 422.")
@click.option("--max-lora-bytes", default=2 << 30, show_default=True, type=int,
              help="Largest LoRA download (Content-Length, and the bytes as they stream); beyond it, 422.")
@click.option("--max-image-bytes", default=32 << 20, show_default=True, type=int,
              help="Largest image or mask a request names by URL.")
@click.option("--max-image-pixels", default=4096 * 4096, show_default=True, type=int,
              help="Largest width x height of a request's image or mask, read from the file's header before any "
                   "pixel is decoded (PIL's decompression-bomb limit follows it); beyond it, 422.")
@click.option("--fetch-per-host", default=2, show_default=True, type=int,
              help="Downloads at once from one host (more wait for a slot, within --fetch-deadline-s).")
@click.option("--max-fetches", default=4, show_default=True, type=int,
              help="Downloads at once in all. Local LoRA files and ones already stored never wait for these.")
@click.option("--max-header-bytes", default=64 << 10, show_default=True, type=int,
              help="A request's headers in all (request line included); beyond it, 431 and the connection closed.")
@click.option("--max-headers", default=100, show_default=True, type=int,
              help="Header lines per request; beyond it, 431 and the connection closed.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--ray", "on_ray", is_flag=True,
              help="Serve on Ray Serve (the ray extra): replicas of this server behind Serve's proxy; "
                   "PREHEAT_CACHE_URL and its credentials reach every replica.")
@click.option("--address", metavar="auto|ray://HOST:PORT",
              help="--ray: the cluster to deploy on (default: start one on this machine).")
@click.option("--replicas", default=1, show_default=True, type=int, help="--ray: replicas.")
@click.option("--gpus-per-replica", default=0.0, show_default=True, type=float,
              help="--ray: GPUs each replica takes (1, or a pod's count; 0 on CPU).")
@one_line_errors
def serve_command(model: Optional[str], host: str, port: int, backend: str, compile_mode: str, dtype: str,
                  weights_dtype: Optional[str], weights_layers: str, variant: Optional[str], cache: Optional[str],
                  config: Optional[str], controlnet: Optional[str], refiner: Optional[str],
                  max_batch_size: int, devices_text: Optional[str], fsdp: int, progress: Optional[bool],
                  batch_wait_ms: float, max_queue: int, max_steps: int,
                  samplers_text: Optional[str], sizes_text: Optional[str], guidance_text: str,
                  inputs_text: Optional[str], input_values_text: Optional[str], lora_ranks_text: Optional[str],
                  max_loras: int, lora_dir: Optional[str],
                  grace_s: float,
                  push_grace_s: float, retune_idle_s_text: str,
                  max_body_bytes: int, header_timeout_s: float, body_timeout_s: float, webhook_allow_private: bool,
                  webhook_allow: tuple[str, ...], lora_url_allow_private: bool, lora_url_allow: tuple[str, ...],
                  fetch_connect_timeout_s: float, fetch_deadline_s: float, max_lora_bytes: int, max_image_bytes: int,
                  max_image_pixels: int, fetch_per_host: int, max_fetches: int, max_header_bytes: int, max_headers: int,
                  keep_alive_on_failure: bool, log_level: str, on_ray: bool = False,
                  address: Optional[str] = None, replicas: int = 1, gpus_per_replica: float = 0.0) -> None:
    """Serve MODEL over HTTP (Cog's and OpenAI's APIs), batching concurrent requests.

    Warm-up compiles every program a request can reach (each offered sampler, guidance on and
    off, every batch bucket and, for text-to-image models, every served size) before
    /health-check says READY: the set `preheat warm` compiles ahead of time with the same
    options. MODEL: a diffusers folder, store source or random:NAME ($PREHEAT_MODEL); nothing for
    the built-in model. Each option that is a deployment setting and is not given is read from its
    PREHEAT_<SETTING> variable (shown below), as Runpod's worker and Ray's replicas read it; a flag
    wins. Set PREHEAT_API_TOKEN to require `Authorization: Bearer <token>` (all but /health-check).
    """
    from preheat.errors import InvalidArgumentError
    from preheat.warm import SettingNames

    name_of = names_of()  # a setting's flag, or its PREHEAT_<SETTING> where the value came from there
    from preheat.server.config import check_limits, parse_idle_s

    check_limits(dict(max_batch_size=max_batch_size, batch_wait_ms=batch_wait_ms, max_queue=max_queue,
                      max_steps=max_steps, max_loras=max_loras, max_image_pixels=max_image_pixels), name_of)
    _check_http_limits(grace_s, header_timeout_s, body_timeout_s, max_body_bytes)
    if push_grace_s < 0:
        raise InvalidArgumentError(f"--push-grace-s {push_grace_s} must be >= 0")
    retune_idle_s = parse_idle_s(retune_idle_s_text, name_of("retune_idle_s"))
    warm_set = warm_set_from_options(model, dtype, max_batch_size, samplers_text, sizes_text, guidance_text,
                                     lora_ranks_text, devices_text, fsdp, variant, cache, weights_dtype,
                                     weights_layers, progress, config, inputs_text, name_of,
                                     input_values_text=input_values_text, controlnet=controlnet, refiner=refiner)
    names = SettingNames.by(name_of)  # set-up messages (an unusable size) name what the user wrote
    webhooks = _address_policy(webhook_allow_private, webhook_allow)
    lora_urls = _address_policy(lora_url_allow_private, lora_url_allow, "--lora-url-allow")
    fetch = _fetch_config(fetch_connect_timeout_s, fetch_deadline_s, max_lora_bytes, max_image_bytes, fetch_per_host,
                          max_fetches)
    if max_header_bytes < 1024 or max_headers < 8:
        raise InvalidArgumentError(f"--max-header-bytes {max_header_bytes} must be >= 1024 and --max-headers "
                                   f"{max_headers} >= 8")
    _check_backend(backend)
    if compile_mode != "none" and backend != "torch":
        raise InvalidArgumentError(f"--compile {compile_mode} applies to --backend torch")
    if weights_dtype is not None and backend != "jax":
        label = name_of("weights_dtype")
        raise InvalidArgumentError(f"{label} applies to --backend jax", argument=label)
    # PREHEAT_DEVICES is the JAX engine's own default wherever it is set (preheat.load), so only a
    # --devices flag is refused for torch; an --fsdp split is refused however it was given
    devices_flag = devices_text is not None and name_of("devices") == flag_of("devices")
    if (devices_flag or fsdp != 1) and backend != "jax":
        raise InvalidArgumentError(f"--devices and {name_of('fsdp')} apply to --backend jax")
    token = os.environ.get("PREHEAT_API_TOKEN") or None
    if host not in _LOOPBACK and token is None:
        click.echo(f"warning: serving on {host} without PREHEAT_API_TOKEN; anyone who can reach it can use it", err=True)
    _setup_logging(log_level)

    if address is not None or replicas != 1 or gpus_per_replica:
        if not on_ray:
            raise InvalidArgumentError("--address, --replicas and --gpus-per-replica apply to --ray")
    if on_ray:
        sys.exit(_serve_on_ray(warm_set, backend, max_loras, lora_dir, batch_wait_ms, max_queue, max_steps, grace_s,
                               push_grace_s, host, port, address, replicas, gpus_per_replica,
                               webhook_allow_private or lora_url_allow_private, webhook_allow + lora_url_allow,
                               max_image_pixels, retune_idle_s, names))

    # a folder that is not there: one line, before the port is bound or JAX imported (a Ray cluster's
    # replicas may read folders this machine does not have: they report their own set-up), unless
    # the platform reads the failure from /health-check (--keep-alive-on-failure: SETUP_FAILED)
    if not keep_alive_on_failure:
        _check_models(warm_set, name_of)
    from preheat.server.core import CoreConfig
    from preheat.server.serve import serve

    config = CoreConfig.from_warm_set(warm_set, backend=backend, batch_wait_ms=batch_wait_ms, max_queue=max_queue,
                                      max_steps=max_steps, push_grace_s=push_grace_s, compile=compile_mode,
                                      max_loras=max_loras, lora_dir=lora_dir, lora_urls=lora_urls, fetch=fetch,
                                      max_image_pixels=max_image_pixels, retune_idle_s=retune_idle_s, names=names)
    try:
        code = serve(config, host=host, port=port, grace_s=grace_s, token=token, log_level=log_level,
                     webhooks=webhooks, max_body_bytes=max_body_bytes, header_timeout_s=header_timeout_s,
                     body_timeout_s=body_timeout_s, max_header_bytes=max_header_bytes, max_headers=max_headers,
                     announce=lambda line: click.echo(line, err=True), keep_alive_on_failure=keep_alive_on_failure)
    except OSError as err:
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sys.exit(code)



def _serve_on_ray(warm_set: Any, backend: str, max_loras: int, lora_dir: Optional[str], batch_wait_ms: float, max_queue: int, max_steps: int,
                  grace_s: float, push_grace_s: float, host: str, port: int, address: Optional[str], replicas: int,
                  gpus_per_replica: float, webhook_allow_private: bool, webhook_allow: tuple[str, ...],
                  max_image_pixels: Optional[int] = None, retune_idle_s: Optional[float] = 30.0,
                  names: Any = None) -> int:
    """``--ray``: the same declaration and limits as one replica's options (preheat.integrations.ray)."""
    from preheat.errors import InvalidArgumentError

    if backend != "jax":
        raise InvalidArgumentError("--ray serves --backend jax")
    if webhook_allow_private or webhook_allow:
        raise InvalidArgumentError("--webhook-allow(-private) and --lora-url-allow(-private) are not passed to Ray "
                                   "replicas; they allow public addresses only")
    if replicas < 1:
        raise InvalidArgumentError(f"--replicas {replicas} must be >= 1")
    if gpus_per_replica < 0:
        raise InvalidArgumentError(f"--gpus-per-replica {gpus_per_replica} must be >= 0")
    try:
        from preheat.integrations import ray as on_ray
    except ImportError as err:
        raise InvalidArgumentError(f"--ray needs the ray extra (pip install 'preheat[ray]'): {err}") from None
    options = on_ray.RayOptions(model=warm_set.model, dtype=warm_set.dtype, variant=warm_set.variant,
                                cache=warm_set.cache, weights_dtype=warm_set.weights_dtype,
                                weights_layers=warm_set.weights_layers, config=warm_set.config,
                                controlnet=warm_set.controlnet, refiner=warm_set.refiner,
                                progress=warm_set.progress, max_batch_size=warm_set.max_batch_size,
                                samplers=tuple(warm_set.samplers), sizes=tuple(warm_set.sizes),
                                guidance=tuple(warm_set.guidance), inputs=warm_set.inputs,
                                input_values=warm_set.input_values,
                                devices=warm_set.devices, fsdp=warm_set.fsdp,
                                lora_ranks=tuple(warm_set.lora_ranks), max_loras=max_loras, lora_dir=lora_dir,
                                max_image_pixels=max_image_pixels, batch_wait_ms=batch_wait_ms,
                                max_queue=max_queue, max_steps=max_steps, grace_s=grace_s, push_grace_s=push_grace_s,
                                num_replicas=replicas, num_gpus=gpus_per_replica, retune_idle_s=retune_idle_s,
                                **({} if names is None else {"names": names}))
    options.check()
    return on_ray.run(options, address=address, host=host, port=port,
                      announce=lambda line: click.echo(line, err=True))
