"""What every route of the HTTP surface shares: the route registry (:class:`Routes`), the
state each route receives (:class:`AppState`, as the ``State`` dependency), waiting for a
prediction while watching the client (:func:`wait_completed`) and the refusals of a full queue
or a server that is not accepting (:func:`refusal`, in Cog's and OpenAI's shapes).

Cog's routes (``preheat.server.app``) and OpenAI's (``preheat.server.openai_routes``) both build
on this module and neither imports the other's routes: ``app`` includes the OpenAI table in its
own, and :func:`preheat.server.app.create_app` adds the whole table to each app. No ``from
__future__ import annotations`` here: FastAPI reads the route annotations (``State``).
"""

import asyncio
import functools
import inspect
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Optional

import httpx
from fastapi import Body, Depends, FastAPI, Request
from fastapi.params import Body as BodyParam
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from preheat.errors import NotAccepting, QueueFull
from preheat.server.core import Core, Prediction
from preheat.server.guard import openai_error
from preheat.server.metrics import HttpMetrics
from preheat.server.webhooks import WebhookPolicy

__all__ = ["Routes", "AppState", "State", "app_state", "refusal", "wait_completed"]


# ---------------------------------------------------------------- the application's state


@dataclass
class AppState:
    """What the routes of one app share (``app.state.preheat``)."""

    core: Core
    webhooks: WebhookPolicy  # which webhook URLs are accepted
    grace_s: float  # how long final webhooks may take at shutdown
    http_metrics: HttpMetrics
    client: Optional[httpx.AsyncClient] = None  # webhook delivery; open while the app runs (lifespan)
    webhook_tasks: set[asyncio.Task] = field(default_factory=set)


def app_state(request: Request) -> AppState:
    return request.app.state.preheat


State = Annotated[AppState, Depends(app_state)]


# ---------------------------------------------------------------- refusals, waiting


def refusal(err: Exception, openai: bool = False) -> JSONResponse:
    if isinstance(err, QueueFull):  # Cog answers 409 when it cannot take a prediction; OpenAI 429
        headers = {"Retry-After": str(err.retry_after)}
        if openai:
            return openai_error(429, str(err), kind="rate_limit_error", headers=headers)
        return JSONResponse({"detail": str(err)}, status_code=409, headers=headers)
    assert isinstance(err, NotAccepting)
    headers = {"Retry-After": "5"} if err.reason == "starting" else {}
    if openai:
        return openai_error(503, str(err), kind="server_error", headers=headers)
    return JSONResponse({"detail": str(err)}, status_code=503, headers=headers)


async def wait_completed(core: Core, pred: Prediction, request: Request) -> Optional[dict[str, Any]]:
    """The final snapshot; None when the client went away first (then the prediction is
    canceled if it is still queued and nobody else waits for it: Core.abandon)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def listener(event: str, snap: dict) -> None:
        if event == "completed":
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(snap))

    core.watch(pred)
    core.subscribe(pred, listener)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if done.done():
        core.unwatch(pred)
        return done.result()
    core.abandon(pred)
    return None


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read: uvicorn's
    ``receive`` then blocks until ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------- the route registry


class Routes:
    """FastAPI's route decorators, recorded here and added to each app by
    ``preheat.server.app.create_app`` (in this order), with request bodies annotated by that app's
    models (:func:`_for_app`). :meth:`include` records another table's routes at that point."""

    def __init__(self) -> None:
        self.table: list[tuple[str, Callable[..., Any], dict[str, Any]]] = []

    def _route(self, method: str, path: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def record(endpoint: Callable[..., Any]) -> Callable[..., Any]:
            self.table.append((path, endpoint, {"methods": [method], **kwargs}))
            return endpoint

        return record

    def get(self, path: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return self._route("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return self._route("POST", path, **kwargs)

    def put(self, path: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return self._route("PUT", path, **kwargs)

    def include(self, other: "Routes") -> None:
        """``other``'s routes, here in this table's order (as FastAPI's ``include_router``)."""
        self.table.extend(other.table)

    def add_to(self, app: FastAPI, models: dict[type[BaseModel], type[BaseModel]]) -> None:
        for path, endpoint, kwargs in self.table:
            app.add_api_route(path, _for_app(endpoint, models), **kwargs)


def _for_app(endpoint: Callable[..., Any], models: dict[type[BaseModel], type[BaseModel]]) -> Callable[..., Any]:
    """``endpoint`` with each body parameter annotated by this app's model (FastAPI reads the
    signature: it validates with, and documents, the annotated class)."""
    signature = inspect.signature(endpoint)
    params = []
    for param in signature.parameters.values():
        model = models.get(param.annotation)
        if model is not None:
            default = param.default
            if isinstance(default, BodyParam) and default.default_factory is param.annotation:
                default = Body(default_factory=model)
            param = param.replace(annotation=model, default=default)
        params.append(param)
    if params == list(signature.parameters.values()):
        return endpoint

    @functools.wraps(endpoint)
    async def route(*args: Any, **kwargs: Any) -> Any:
        return await endpoint(*args, **kwargs)

    route.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return route
