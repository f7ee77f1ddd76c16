"""Click commands: ``preheat serve`` and ``preheat bench serve`` (registered by preheat.cli).

Importing this module is cheap (no JAX, FastAPI or uvicorn until a command runs).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import click

__all__ = ["serve_command", "bench_serve_command"]

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _one_line_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """preheat.cli's one-line error handling, imported when the command runs (no import cycle)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from preheat._cli_support import one_line_errors

        return one_line_errors(fn)(*args, **kwargs)

    return wrapper


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
        import preheat.backends.torch as torch_backend
    except ImportError as err:
        raise InvalidArgumentError(f"--backend torch needs the torch extra: {err}") from None
    if getattr(torch_backend, "load", None) is None:
        raise InvalidArgumentError("--backend torch: preheat.backends.torch provides no pipeline yet; use --backend jax")


def _check_limits(max_batch_size: int, batch_wait_ms: float, max_queue: int, max_steps: int, grace_s: float,
                  header_timeout_s: float = 10.0, body_timeout_s: float = 30.0, max_body_bytes: int = 1 << 20) -> None:
    from preheat.errors import InvalidArgumentError

    if max_batch_size < 1 or max_batch_size > 1024:
        raise InvalidArgumentError(f"--max-batch-size {max_batch_size} must be in 1..1024")
    if batch_wait_ms < 0:
        raise InvalidArgumentError(f"--batch-wait-ms {batch_wait_ms} must be >= 0")
    if max_queue < 1:
        raise InvalidArgumentError(f"--max-queue {max_queue} must be >= 1")
    if max_steps < 1:
        raise InvalidArgumentError(f"--max-steps {max_steps} must be >= 1")
    if grace_s < 0:
        raise InvalidArgumentError(f"--grace-s {grace_s} must be >= 0")
    if header_timeout_s <= 0:
        raise InvalidArgumentError(f"--header-timeout-s {header_timeout_s} must be > 0")
    if body_timeout_s <= 0:
        raise InvalidArgumentError(f"--body-timeout-s {body_timeout_s} must be > 0")
    if max_body_bytes < 1:
        raise InvalidArgumentError(f"--max-body-bytes {max_body_bytes} must be >= 1")


def _samplers(text: Optional[str]) -> tuple[str, ...]:
    """``--samplers a,b`` -> ("a", "b"); unknown names fail in one line."""
    from preheat.errors import SchedulerConfigError
    from preheat.samplers import SAMPLERS

    names = tuple(dict.fromkeys(n.strip() for n in (text or "").split(",") if n.strip()))
    for name in names:
        if name not in SAMPLERS:
            raise SchedulerConfigError(f"--samplers {name!r} is unknown; choose from {', '.join(SAMPLERS)}")
    return names


def _sizes(text: Optional[str]) -> tuple[tuple[int, int], ...]:
    """``--sizes 512x512,768x512`` -> ((512, 512), (768, 512)); a malformed entry fails in one line."""
    from preheat.errors import InvalidArgumentError

    out = []
    for item in (text or "").split(","):
        item = item.strip().lower()
        if not item:
            continue
        w, sep, h = item.partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or int(w) <= 0 or int(h) <= 0:
            raise InvalidArgumentError(f"--sizes {item!r} must be WIDTHxHEIGHT, e.g. 512x512")
        out.append((int(w), int(h)))
    return tuple(dict.fromkeys(out))


def _webhook_policy(allow_private: bool, allow: tuple[str, ...]) -> Any:
    from preheat.errors import InvalidArgumentError
    from preheat.server.webhooks import WebhookPolicy, WebhookRefused

    try:
        return WebhookPolicy(allow_private=allow_private, allow=tuple(allow))
    except WebhookRefused as err:
        raise InvalidArgumentError(f"--webhook-allow: {err}") from None


@click.command("serve")
@click.argument("model", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (loopback unless told).")
@click.option("--port", default=8000, show_default=True, type=int, help="Port (0 = any free port, printed at start).")
@click.option("--backend", default="jax", show_default=True, type=click.Choice(["jax", "torch"]))
@click.option("--compile", "compile_mode", default="none", show_default=True,
              type=click.Choice(["none", "inductor", "aot", "regional"]),
              help="--backend torch: eager, torch.compile, AOTInductor or regional (the repeated blocks).")
@click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16 or float16.")
@click.option("--max-batch-size", default=8, show_default=True, type=int,
              help="Largest engine batch; buckets 1, 2, 4 ... up to it are compiled at start-up.")
@click.option("--batch-wait-ms", default=10.0, show_default=True, type=float,
              help="How long the oldest request waits for others to share its batch.")
@click.option("--max-queue", default=64, show_default=True, type=int,
              help="Predictions allowed to wait; beyond it, 409 (Cog) / 429 (OpenAI) with Retry-After.")
@click.option("--max-steps", default=200, show_default=True, type=int, help="Largest num_inference_steps accepted.")
@click.option("--samplers", "samplers_text", metavar="A,B,...",
              help="Samplers offered (all compiled at start-up; others get 422). Default: the model's own.")
@click.option("--sizes", "sizes_text", metavar="WxH,...",
              help="Text-to-image: sizes served (each compiled at start-up; others get 422). Default: the model's.")
@click.option("--grace-s", default=30.0, show_default=True, type=float,
              help="On SIGTERM, how long in-flight predictions may take to finish.")
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
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@_one_line_errors
def serve_command(model: Optional[str], host: str, port: int, backend: str, compile_mode: str, dtype: str,
                  max_batch_size: int,
                  batch_wait_ms: float, max_queue: int, max_steps: int, samplers_text: Optional[str],
                  sizes_text: Optional[str], grace_s: float,
                  max_body_bytes: int, header_timeout_s: float, body_timeout_s: float, webhook_allow_private: bool,
                  webhook_allow: tuple[str, ...], log_level: str) -> None:
    """Serve MODEL over HTTP (Cog's and OpenAI's APIs), batching concurrent requests.

    Warm-up compiles every program a request can reach (each offered sampler, guidance on and
    off, every batch bucket and, for text-to-image models, every served size) before
    /health-check says READY. Set
    PREHEAT_API_TOKEN to require `Authorization: Bearer <token>` (all but /health-check).
    """
    from preheat.errors import InvalidArgumentError

    _check_limits(max_batch_size, batch_wait_ms, max_queue, max_steps, grace_s, header_timeout_s, body_timeout_s,
                  max_body_bytes)
    samplers = _samplers(samplers_text)
    sizes = _sizes(sizes_text)
    webhooks = _webhook_policy(webhook_allow_private, webhook_allow)
    _check_backend(backend)
    if compile_mode != "none" and backend != "torch":
        raise InvalidArgumentError(f"--compile {compile_mode} applies to --backend torch")
    token = os.environ.get("PREHEAT_API_TOKEN") or None
    if host not in _LOOPBACK and token is None:
        click.echo(f"warning: serving on {host} without PREHEAT_API_TOKEN; anyone who can reach it can use it", err=True)
    _setup_logging(log_level)

    from preheat.server.core import CoreConfig
    from preheat.server.serve import serve

    config = CoreConfig(model=model, backend=backend, compile=compile_mode, dtype=dtype, max_batch_size=max_batch_size,
                        batch_wait_ms=batch_wait_ms, max_queue=max_queue, max_steps=max_steps,
                        samplers=samplers, sizes=sizes)
    try:
        code = serve(config, host=host, port=port, grace_s=grace_s, token=token, log_level=log_level,
                     webhooks=webhooks, max_body_bytes=max_body_bytes, header_timeout_s=header_timeout_s,
                     body_timeout_s=body_timeout_s, announce=lambda line: click.echo(line, err=True))
    except OSError as err:
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sys.exit(code)


@click.command("serve")
@click.argument("model", required=False)
@click.option("--requests", "n_requests", default=256, show_default=True, type=int, help="Requests to send in all.")
@click.option("--concurrency", default=32, show_default=True, type=int, help="Concurrent clients.")
@click.option("--max-batch-size", default=8, show_default=True, type=int)
@click.option("--batch-wait-ms", default=10.0, show_default=True, type=float)
@click.option("--steps", type=int, help="num_inference_steps per request (model default when absent).")
@click.option("--timeout-s", default=600.0, show_default=True, type=float, help="Give up after this long in all.")
@click.option("--offline-s", default=8.0, show_default=True, type=float,
              help="Seconds to time the offline baseline (before and after the load).")
@click.option("--json", "json_out", default="bench-serve.json", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="Write the results here.")
@_one_line_errors
def bench_serve_command(model: Optional[str], n_requests: int, concurrency: int, max_batch_size: int,
                        batch_wait_ms: float, steps: Optional[int], timeout_s: float, offline_s: float,
                        json_out: Path) -> None:
    """Load-test `preheat serve` on 127.0.0.1: throughput vs offline batching, latency, exactly-once."""
    from preheat.errors import InvalidArgumentError
    from preheat.server.bench import markdown, run_bench

    if n_requests < 1 or concurrency < 1 or max_batch_size < 1 or timeout_s <= 0 or offline_s <= 0:
        raise InvalidArgumentError("--requests, --concurrency, --max-batch-size, --timeout-s and --offline-s must be positive")
    if steps is not None and steps < 1:
        raise InvalidArgumentError(f"--steps {steps} must be a positive int")
    result = run_bench(model, n_requests=n_requests, concurrency=concurrency, max_batch_size=max_batch_size,
                       batch_wait_ms=batch_wait_ms, steps=steps, timeout_s=timeout_s, offline_s=offline_s,
                       json_out=json_out,
                       log=lambda line: click.echo(line, err=True))
    click.echo(markdown(result))
    click.echo(f"wrote {json_out}", err=True)
    if not result["exactly_once"] or result["server_exit_code"] != 0:
        sys.exit(1)
