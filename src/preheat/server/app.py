"""The HTTP surface: thin FastAPI routes over a :class:`~preheat.server.core.Core`.

Cog's contract (``/health-check``, ``/predictions``, ``PUT /predictions/{id}``,
``/predictions/{id}/cancel``, ``Prefer: respond-async`` + webhooks), Prometheus ``/metrics``,
and (a table of their own, included here) OpenAI-style ``/v1/images/generations`` and
``/v1/images/edits``: ``preheat.server.openai_routes``. No ``from __future__ import
annotations`` here: FastAPI reads the route annotations.

The routes are module-level functions, written as in FastAPI's examples, over one
:class:`~preheat.server.routing.AppState` per app (the core, webhook delivery, HTTP metrics),
which each route receives as a dependency (``preheat.server.routing``: the route registry and
what every route shares). Two request bodies carry bounds from the server's limits (``input`` is
the served model's own ``Input``; ``n`` and ``seed`` of the OpenAI body depend on the largest
batch) so that the OpenAPI document states the real bounds: :func:`request_models` derives this
app's versions of :class:`PredictionRequest` and ``ImageGenerationRequest``, and
:func:`create_app` adds every route with its body annotated by them.

Auth, body limits and HTTP metrics are the outermost ASGI layer, :class:`~preheat.server.guard.Guard`.
"""

import asyncio
import functools
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Callable, Literal, Optional

import httpx
from fastapi import Body, FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException

from preheat.errors import InputError, NotAccepting, QueueFull
from preheat.families.inputs import Image, size_pair
from preheat.families.offer import served_values, static_inputs
from preheat.server import openai_routes
from preheat.server.core import Core, Prediction
from preheat.server.guard import BODY_TIMEOUT_S, MAX_BODY_BYTES, Guard, api_error, openai_error
from preheat.server.inputs import Limits, offered, served_sizes
from preheat.server.metrics import HttpMetrics
from preheat.server.openai_routes import ImageGenerationRequest, images_request_model
from preheat.server.routing import AppState, Routes, State, refusal, wait_completed
from preheat.server.stream import stream_prediction, wants_stream
from preheat.server.webhooks import WebhookPolicy, WebhookRefused, delivery_client

__all__ = ["create_app", "request_models", "PredictionRequest", "PredictionResponse"]

log = logging.getLogger("preheat.server")

WEBHOOK_EVENTS = ("start", "output", "logs", "completed")
LOGS_INTERVAL_S = 0.5  # at most one "logs" webhook per this many seconds (Cog's throttle)


def _detail(errors: list[tuple[str, str]], prefix: tuple[str, ...] = ("body", "input")) -> list[dict[str, Any]]:
    return [{"loc": [*prefix, f], "msg": m, "type": "value_error"} for f, m in errors]


def _wants_async(prefer: Optional[str]) -> bool:
    if not prefer:
        return False
    return any(token.split(";")[0].strip().lower() == "respond-async" for token in prefer.split(","))


# ---------------------------------------------------------------- request and response bodies
# No docstrings on these: pydantic would put them in the OpenAPI document as descriptions.


class PredictionRequest(BaseModel):
    # Cog's body. ``input`` is the served model's Input (preheat.server.inputs.input_model); this
    # app's version of the class has it (request_models).
    model_config = ConfigDict(extra="ignore")  # Cog's director sends more top-level keys over time
    input: dict[str, Any] = Field(default_factory=dict)
    id: Optional[str] = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")
    created_at: Optional[str] = Field(None, max_length=64)
    webhook: Optional[AnyHttpUrl] = None
    webhook_events_filter: Optional[list[Literal[WEBHOOK_EVENTS]]] = Field(None, max_length=4)  # type: ignore[valid-type]
    output_file_prefix: Optional[str] = Field(None, max_length=1000)


class PredictionResponse(BaseModel):
    id: Optional[str] = None
    status: Literal["starting", "processing", "succeeded", "failed", "canceled"]
    input: dict[str, Any] = {}
    output: Optional[list[str]] = None
    error: Optional[str] = None
    logs: str = ""
    metrics: dict[str, Any] = {}
    created_at: Optional[str] = None
    started_at: Optional[str] = None
    completed_at: Optional[str] = None



def request_models(input_model: type[BaseModel], limits: Limits) -> dict[type[BaseModel], type[BaseModel]]:
    """This app's request bodies, by the module-level class they narrow: the served model's
    ``Input`` in Cog's body, the largest batch's bounds in OpenAI's."""
    prediction = create_model("PredictionRequest", __base__=PredictionRequest,
                              input=(input_model, Field(default_factory=input_model)))
    return {PredictionRequest: prediction, ImageGenerationRequest: images_request_model(limits)}


# ---------------------------------------------------------------- the application's lifespan



@asynccontextmanager
async def lifespan(app: FastAPI):
    state: AppState = app.state.preheat
    state.client = delivery_client()
    try:
        yield
    finally:
        if state.webhook_tasks:  # final webhooks of drained predictions
            await asyncio.wait(list(state.webhook_tasks), timeout=state.grace_s)
        await state.client.aclose()


# ---------------------------------------------------------------- errors: 4xx, never a traceback


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "invalid")), "type": str(e.get("type", "value_error"))}
              for e in exc.errors()]
    if request.url.path.startswith("/v1/"):
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        fields = [str(p) for p in first["loc"] if p != "body" and not isinstance(p, int)]
        return openai_error(422, f"{'.'.join(fields) or 'body'}: {first['msg']}", fields[0] if fields else None)
    return JSONResponse({"detail": errors}, status_code=422)


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    status = exc.status_code
    if status == 400 and "parsing the body" in str(exc.detail):  # undecodable JSON (e.g. huge ints)
        status = 422
    headers = getattr(exc, "headers", None)
    if request.url.path.startswith("/v1/"):
        return api_error(request.scope, status, str(exc.detail), headers)
    return JSONResponse({"detail": exc.detail}, status_code=status, headers=headers)


async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("internal error on %s %s", request.method, request.url.path)
    return api_error(request.scope, 500, f"internal error: {type(exc).__name__}")


EXCEPTION_HANDLERS: tuple[tuple[type[Exception], Callable[..., Any]], ...] = (
    (RequestValidationError, on_validation_error),
    (StarletteHTTPException, on_http_error),
    (Exception, on_internal_error),
)


def conflict(pid: str) -> JSONResponse:
    return JSONResponse({"detail": f"prediction {pid} exists with a different input"}, status_code=409)

# ---------------------------------------------------------------- predictions: waiting, webhooks


def webhook_listener(state: AppState, url: str, events: set[str]) -> Any:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def deliver() -> None:
        last_logs = float("-inf")
        while True:
            event, snap = await queue.get()
            if event == "abort":  # the prediction was never created
                return
            if event == "start" and events & {"start", "logs"}:
                await post_webhook(state, url, snap, attempts=1)
            # Cog throttles "logs" webhooks to one per 500 ms; "completed" carries the last lines
            if event == "log" and "logs" in events and time.monotonic() - last_logs >= LOGS_INTERVAL_S:
                last_logs = time.monotonic()
                await post_webhook(state, url, snap, attempts=1)
            if event == "completed":
                if events & {"completed", "output", "logs"}:
                    await post_webhook(state, url, snap, attempts=3)
                return

    task = loop.create_task(deliver())
    state.webhook_tasks.add(task)
    task.add_done_callback(state.webhook_tasks.discard)

    def listener(event: str, snap: dict) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (event, snap))

    def abort() -> None:
        queue.put_nowait(("abort", {}))

    return listener, abort


async def post_webhook(state: AppState, url: str, snap: dict, attempts: int) -> None:
    for attempt in range(attempts):
        try:
            response = await state.webhooks.post(state.client, url, snap)  # the checked address, no redirects
            if response.status_code < 500:
                return
        except WebhookRefused as err:  # DNS changed since the prediction was accepted
            log.warning("webhook %s refused: %s", url, err)
            return
        except httpx.HTTPError as err:
            log.warning("webhook %s failed: %s", url, err)
        if attempt + 1 < attempts:
            await asyncio.sleep(0.5 * 2**attempt)


def same_input(core: Core, existing: Prediction, body: Any) -> bool:
    """Whether a retry asks for the existing prediction (raises ``InputError`` when invalid)."""
    if existing.input == body.input.model_dump(exclude_unset=True):
        return True
    return core.same_request(existing, body.input)


async def attach(core: Core, pred: Prediction, respond_async: bool, request: Request) -> Response:
    if respond_async:
        return JSONResponse(core.snapshot(pred), status_code=202)
    if wants_stream(request.headers.get("accept")):  # Cog's server-sent events (preheat.server.stream)
        return stream_prediction(core, pred)
    snap = await wait_completed(core, pred, request)
    if snap is None:
        return JSONResponse({"detail": "the client went away"}, status_code=499)
    return JSONResponse(snap)


async def predict(state: AppState, body: Any, prediction_id: Optional[str], prefer: Optional[str],
                  request: Request) -> Response:
    core = state.core
    respond_async = _wants_async(prefer)
    pid = prediction_id or body.id
    existing = core.get(pid) if pid else None
    if existing is not None:  # an idempotent retry: attach to it (running or finished)
        try:
            if not same_input(core, existing, body):
                return conflict(pid)
        except InputError as err:
            return JSONResponse({"detail": _detail(err.errors)}, status_code=422)
        return await attach(core, existing, respond_async, request)
    try:
        job, given = await core.parse_async(body.input)
    except InputError as err:
        return JSONResponse({"detail": _detail(err.errors)}, status_code=422)
    except NotAccepting as err:
        return refusal(err)
    extra: dict[str, Any] = {}
    listener, abort = None, None
    if body.webhook is not None:
        try:
            await state.webhooks.resolve(str(body.webhook))  # refused before anything is sent anywhere
        except WebhookRefused as err:
            return JSONResponse({"detail": _detail([("webhook", str(err))], ("body",))}, status_code=422)
        events = set(body.webhook_events_filter) if body.webhook_events_filter is not None else set(WEBHOOK_EVENTS)
        extra = {"webhook": str(body.webhook), "webhook_events_filter": sorted(events)}
        listener, abort = webhook_listener(state, str(body.webhook), events)
    try:
        pred, created = core.submit(job, given, pid, listener=listener, extra=extra, created_at=body.created_at,
                                    respond_async=respond_async)
    except (QueueFull, NotAccepting) as err:
        if abort is not None:
            abort()
        return refusal(err)
    if not created:  # lost a race with a retry of the same id: the first request owns the webhook
        if abort is not None:
            abort()
        if not same_input(core, pred, body):
            return conflict(pid)
    return await attach(core, pred, respond_async, request)


# ---------------------------------------------------------------- the routes


routes = Routes()

PREDICTION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": PredictionResponse}, 202: {"model": PredictionResponse, "description": "Accepted (Prefer: respond-async)"},
    408: {"description": "The body did not arrive in time"},
    409: {"description": "The id exists with a different input, or the queue is full (see Retry-After)"},
    413: {"description": "Body too large"},
    415: {"description": "Body is not JSON"},
    422: {"description": "Invalid input; detail names the field"},
    503: {"description": "Starting, set-up failed or draining"},
}


@routes.get("/", include_in_schema=False)
async def root() -> Response:
    return RedirectResponse("/playground", status_code=307)


@routes.get("/playground", include_in_schema=False)
async def playground() -> Response:
    """A page to try the model in a browser (self-contained; see preheat.server.playground)."""
    from preheat.server.playground import HEADERS, PAGE

    return Response(PAGE, media_type="text/html; charset=utf-8", headers=HEADERS)


@routes.get("/docs", include_in_schema=False)
async def docs(request: Request) -> Response:
    """The API reference, self-contained (works offline; see preheat.server.docs_page)."""
    from preheat.server.docs_page import render

    return Response(render(openapi(request.app)), media_type="text/html; charset=utf-8")


@routes.get("/health-check", summary="Health check (never needs a token)")
async def health_check(state: State) -> dict[str, Any]:
    core = state.core
    status = core.status
    out: dict[str, Any] = {"status": status, "setup": core.setup.as_dict()}
    if status == "SETUP_FAILED":
        out["error"] = core.setup.error
    if core.draining:
        out["draining"] = True
    if status == "DEFUNCT":
        out["error"] = core.defunct
    out["queue_depth"] = core.queue_depth
    return out


@routes.post("/predictions", summary="Run a prediction", responses=PREDICTION_RESPONSES)
async def create_prediction(raw: Request, state: State,
                            request: PredictionRequest = Body(default_factory=PredictionRequest),
                            prefer: Optional[str] = Header(default=None)) -> Response:
    return await predict(state, request, None, prefer, raw)


@routes.put("/predictions/{prediction_id}", summary="Run a prediction, idempotently by id",
            responses=PREDICTION_RESPONSES)
async def put_prediction(raw: Request, state: State,
                         prediction_id: str = Path(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$"),
                         request: PredictionRequest = Body(default_factory=PredictionRequest),
                         prefer: Optional[str] = Header(default=None)) -> Response:
    if request.id is not None and request.id != prediction_id:
        return JSONResponse({"detail": _detail([("id", "prediction ID must match the ID supplied in the URL")],
                                               ("body",))}, status_code=422)
    return await predict(state, request, prediction_id, prefer, raw)


@routes.get("/predictions/{prediction_id}", summary="Current state of a prediction (extension)",
            responses={200: {"model": PredictionResponse}, 404: {"description": "Unknown id"}})
async def get_prediction(state: State, prediction_id: str = Path(..., min_length=1, max_length=128)) -> Response:
    pred = state.core.get(prediction_id)
    if pred is None:
        return JSONResponse({"detail": "prediction not found"}, status_code=404)
    return JSONResponse(state.core.snapshot(pred))


@routes.post("/predictions/{prediction_id}/cancel", summary="Cancel a prediction",
             responses={404: {"description": "Unknown id"}})
async def cancel_prediction(state: State, prediction_id: str = Path(..., min_length=1, max_length=128)) -> Response:
    if not state.core.cancel(prediction_id):
        return JSONResponse({}, status_code=404)
    return JSONResponse({}, status_code=200)


routes.include(openai_routes.routes)  # POST /v1/images/generations, POST /v1/images/edits


@routes.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(state: State) -> Response:
    return Response(generate_latest(state.http_metrics.registry), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------- OpenAPI: the model's own choices


def openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus (once the model is loaded) what only the model knows: its
    classes and its image size, as enums, so that schema-valid input is accepted input."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    core = app.state.preheat.core
    spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    if core.setup.status == "succeeded":
        _describe_model(spec, core.pipe, core.samplers, core.limits)
        app.openapi_schema = spec  # final: cache it
    return spec


def create_app(core: Core, *, token: Optional[str] = None, grace_s: float = 30.0,
               webhooks: WebhookPolicy = WebhookPolicy(), max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S) -> Any:
    """A FastAPI app (wrapped in the auth/limits/metrics guard) serving ``core``. ``token``: when
    set, every endpoint but ``/health-check`` needs ``Authorization: Bearer <token>``.
    ``webhooks``: which webhook URLs are accepted (default: public addresses only)."""
    app = FastAPI(title="preheat", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Diffusion sampling server (Cog- and OpenAI-compatible). Starts hot, batches requests.")
    app.state.preheat = AppState(core, webhooks, grace_s, HttpMetrics(core.metrics.registry))
    for exc_class, handler in EXCEPTION_HANDLERS:
        app.add_exception_handler(exc_class, handler)
    routes.add_to(app, request_models(core.input_model, core.limits))
    app.openapi = functools.partial(openapi, app)  # type: ignore[method-assign]

    guarded = Guard(app, token or None, app.state.preheat.http_metrics, max_body_bytes=max_body_bytes,
                     body_timeout_s=body_timeout_s)
    guarded.fastapi = app  # type: ignore[attr-defined]
    return guarded


def _title(name: str) -> str:
    return name.replace("_", " ").title()


def _nullable(schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """An optional input's schema: its type or null; description and default at the top."""
    schema = dict(schema)
    top = {k: schema.pop(k) for k in ("description", "default") if k in schema}
    return {"anyOf": [schema, {"type": "null"}], **top, **extra}


def _describe_model(spec: dict[str, Any], pipe: Any, samplers: tuple[str, ...] = (), limits: Any = None) -> None:
    """The served family's offered inputs (``server.inputs.offered``: its declaration less what
    ``--inputs`` leaves out) in the schema: each one's type, bounds and description, served sizes
    as enums, so that schema-valid input is accepted input."""
    schemas = spec.get("components", {}).get("schemas", {})
    limits = limits or Limits()
    specs = tuple(s for s in offered(pipe, limits) if "server" in s.surfaces)
    sizes = served_sizes(pipe, limits)
    pair = size_pair(specs)
    served = {} if pair is None else pair.inputs((sorted({w for w, _ in sizes}), sorted({h for _, h in sizes})))
    # any other static input (a T5 prompt's length): its served values (--input-values), the first its default
    statics = {s.name: served_values(s, limits.input_values) for s in static_inputs(specs)}
    props: dict[str, Any] = {}
    by_name = {s.name: s for s in specs}
    for order, s in enumerate(specs):
        schema = s.schema()
        hints: dict[str, Any] = {"x-order": order}
        if s.name in served:  # one side of the size (the playground shows the pair as one size <select>)
            schema = {"type": "integer", "enum": served[s.name], "description": s.description}
            hints["x-size"] = pair.index(s.name)  # 0: the width, 1: the height
        elif s.name in statics:
            schema = {**schema, "enum": list(statics[s.name]), "default": statics[s.name][0]}
        if isinstance(s.type, Image) and s.type.mask and s.needs:  # the image it masks (the page draws on it)
            hints["x-mask-of"] = by_name[s.needs[0]].surface_name
        if s.required:
            schema["description"] = f"{schema.get('description', '')} Required.".strip()
            props[s.surface_name] = {**schema, "title": _title(s.surface_name), **hints}
        else:
            props[s.surface_name] = _nullable(schema, title=_title(s.surface_name), **hints)
        for alias in s.aliases:
            alias_schema = {**s.schema(), "description": f"Another way to give {s.surface_name}: {s.description}"}
            props.setdefault(alias, _nullable(alias_schema, title=_title(alias),
                                              **{"x-order": order, "x-alias-of": s.surface_name}))
    model_input = schemas.get("Input", {})
    if model_input.get("properties") is not None:
        model_input["properties"].update(props)
        model_input["additionalProperties"] = False
        scheduler = model_input["properties"].get("scheduler")
        if samplers and scheduler is not None:  # what warm-up compiled; every other sampler is refused
            scheduler["anyOf"] = [{"type": "string", "enum": list(samplers)}, {"type": "null"}]
        lora = model_input["properties"].get("lora_weights")
        if lora is not None and limits is not None and limits.lora_dir is not None:  # what --lora-dir serves
            from preheat.server.playground import lora_choices

            lora["examples"] = lora_choices(limits.lora_dir)
    openai_routes.describe(spec, props, specs, served, sizes)  # the same inputs on the OpenAI routes


def _version() -> str:
    from preheat._version import __version__

    return __version__
