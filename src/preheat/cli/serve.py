"""`preheat serve`: the HTTP server's options, checked in one line before anything loads.

Importing this module is cheap (no JAX, FastAPI or uvicorn until a command runs).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from preheat.cli._support import one_line_errors
from preheat.cli.settings_env import SettingsCommand, flag_of, names_of, settings_given, settings_options

__all__ = ["serve_command"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _check_backend(backend: str) -> None:
    from preheat.errors import InvalidArgumentError

    if backend == "jax":
        return
    try:
        from preheat.backends.torch import load_torch_pipeline

        del load_torch_pipeline  # imported to refuse before serving, not at set-up
    except ImportError as err:
        raise InvalidArgumentError(f"--backend torch needs the torch extra: {err}") from None


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


@click.command("serve", cls=SettingsCommand)
@settings_options("serve")
@one_line_errors
def serve_command(**given: Any) -> None:
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
    from preheat.server.config import CoreConfig, check_backend, http_options, log_to_stderr
    from preheat.warm import SettingNames

    settings = settings_given(given)
    name_of = names_of()  # a setting's flag, or its PREHEAT_<SETTING> where the value came from there
    settings.check_serving(name_of)
    warm_set = settings.warm_set(name_of)
    names = SettingNames.by(name_of)  # set-up messages (an unusable size) name what the user wrote
    config = CoreConfig.from_settings(settings, warm_set, names, name_of)  # a bad address or fetch limit: one line
    token = os.environ.get("PREHEAT_API_TOKEN") or None
    http = http_options(settings, token)
    backend = settings.backend
    _check_backend(backend)
    check_backend(settings, name_of("weights_dtype"))
    # PREHEAT_DEVICES is the JAX engine's own default wherever it is set (preheat.load), so only a
    # --devices flag is refused for torch; an --fsdp split is refused however it was given
    devices_flag = settings.devices is not None and name_of("devices") == flag_of("devices")
    if (devices_flag or settings.fsdp != 1) and backend != "jax":
        raise InvalidArgumentError(f"--devices and {name_of('fsdp')} apply to --backend jax")
    if settings.host not in _LOOPBACK and token is None:
        click.echo(f"warning: serving on {settings.host} without PREHEAT_API_TOKEN; anyone who can reach it can use "
                   "it", err=True)
    log_to_stderr(settings.log_level)

    if settings.address is not None or settings.replicas != 1 or settings.gpus_per_replica:
        if not settings.on_ray:
            raise InvalidArgumentError("--address, --replicas and --gpus-per-replica apply to --ray")
    if settings.on_ray:
        sys.exit(_serve_on_ray(settings, config))

    # a folder that is not there: one line, before the port is bound or JAX imported (a Ray cluster's
    # replicas may read folders this machine does not have: they report their own set-up), unless
    # the platform reads the failure from /health-check (--keep-alive-on-failure: SETUP_FAILED)
    if not settings.keep_alive_on_failure:
        _check_models(warm_set, name_of)
    from preheat.server.serve import serve

    try:
        code = serve(config, **http, announce=lambda line: click.echo(line, err=True))
    except OSError as err:
        raise InvalidArgumentError(f"cannot listen on {settings.host}:{settings.port}: {err.strerror or err}") from None
    sys.exit(code)


def _serve_on_ray(settings: Any, config: Any) -> int:
    """``--ray``: the same declaration and limits as one replica's options (preheat.integrations.ray)."""
    from preheat.errors import InvalidArgumentError

    if settings.backend != "jax":
        raise InvalidArgumentError("--ray serves --backend jax")
    if settings.webhook_allow_private or settings.lora_url_allow_private or settings.webhook_allow or \
            settings.lora_url_allow:
        raise InvalidArgumentError("--webhook-allow(-private) and --lora-url-allow(-private) are not passed to Ray "
                                   "replicas; they allow public addresses only")
    if settings.replicas < 1:
        raise InvalidArgumentError(f"--replicas {settings.replicas} must be >= 1")
    if settings.gpus_per_replica < 0:
        raise InvalidArgumentError(f"--gpus-per-replica {settings.gpus_per_replica} must be >= 0")
    try:
        from preheat.integrations import ray as on_ray
    except ImportError as err:
        raise InvalidArgumentError(f"--ray needs the ray extra (pip install 'preheat[ray]'): {err}") from None
    options = on_ray.RayOptions.from_core(config, grace_s=settings.grace_s, num_replicas=settings.replicas,
                                          num_gpus=settings.gpus_per_replica)
    options.check()
    return on_ray.run(options, address=settings.address, host=settings.host, port=settings.port,
                      announce=lambda line: click.echo(line, err=True))
