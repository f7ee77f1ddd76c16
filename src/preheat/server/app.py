"""The HTTP surface: thin FastAPI routes over a :class:`~preheat.server.core.Core`.

Cog's contract (``/health-check``, ``/predictions``, ``PUT /predictions/{id}``,
``/predictions/{id}/cancel``, ``Prefer: respond-async`` + webhooks), an OpenAI-style
``/v1/images/generations``, Prometheus ``/metrics``. No ``from __future__ import annotations``
here: FastAPI reads the route annotations, and the input models are built per app.

Limits enforced by the outermost ASGI layer (:class:`_Guard`), for every transfer encoding:
the body is counted while it streams in and reading stops at ``max_body_bytes`` (413); a body
must arrive within ``body_timeout_s`` of the request's first read (408); a body that is not
JSON is refused (415). Header read timeouts live in the protocol (``preheat.server.serve``).
"""

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, Literal, Optional

import httpx
from fastapi import Body, FastAPI, Header, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException

from preheat.server.core import SHUT_DOWN, Core, NotAccepting, Prediction, QueueFull
from preheat.server.inputs import SEED_MAX, InputError, json_int
from preheat.server.metrics import HttpMetrics
from preheat.server.webhooks import WebhookPolicy, WebhookRefused, delivery_client

__all__ = ["create_app"]

log = logging.getLogger("preheat.server")

WEBHOOK_EVENTS = ("start", "output", "logs", "completed")
MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_S = 30.0
_OPENAI_FIELDS = {"num_outputs": "n", "width": "size", "height": "size"}


def _detail(errors: list[tuple[str, str]], prefix: tuple[str, ...] = ("body", "input")) -> list[dict[str, Any]]:
    return [{"loc": [*prefix, f], "msg": m, "type": "value_error"} for f, m in errors]


def _openai_error(status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                  headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status, headers=headers)


def _wants_async(prefer: Optional[str]) -> bool:
    if not prefer:
        return False
    return any(token.split(";")[0].strip().lower() == "respond-async" for token in prefer.split(","))


class _BodyRefused(Exception):
    """Raised into the app by the guard's ``receive`` when the body breaks a limit."""


class _Body:
    """The guard's ``receive``: counts body bytes as they stream in and times the body out.
    On a breach it records the refusal and raises into the app (which stops reading)."""

    def __init__(self, receive: Any, max_bytes: int, timeout_s: float) -> None:
        self.receive, self.max_bytes, self.timeout_s = receive, max_bytes, timeout_s
        self.seen = 0
        self.complete = False
        self.deadline: Optional[float] = None
        self.refusal: Optional[tuple[int, str]] = None

    async def __call__(self) -> dict:
        if self.refusal is not None:
            raise _BodyRefused(self.refusal[1])
        if self.complete:  # after the body: only http.disconnect is left to wait for
            return await self.receive()
        loop = asyncio.get_running_loop()
        if self.deadline is None:
            self.deadline = loop.time() + self.timeout_s
        try:
            message = await asyncio.wait_for(self.receive(), max(0.0, self.deadline - loop.time()))
        except asyncio.TimeoutError:
            self.refusal = (408, f"the request body did not arrive within {self.timeout_s:g}s")
            raise _BodyRefused(self.refusal[1]) from None
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.max_bytes:
                self.refusal = (413, f"request body over {self.max_bytes} bytes")
                raise _BodyRefused(self.refusal[1])
            if not message.get("more_body", False):
                self.complete = True
        return message


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";")[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


class _Guard:
    """Outermost ASGI layer: bearer-token auth, body limits (size, time, JSON only), HTTP metrics
    (never raises)."""

    def __init__(self, app: Any, token: Optional[str], metrics: HttpMetrics, max_body_bytes: int = MAX_BODY_BYTES,
                 body_timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {token}".encode() if token else None
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        code = {"status": 500}
        body = _Body(receive, self.max_body_bytes, self.body_timeout_s)
        sent = {"started": False}

        async def send_wrapper(message: dict) -> None:
            if body.refusal is not None and not sent["started"]:
                return  # the app's answer to the exception raised into it; ours goes out below
            await send_out(message)

        async def send_out(message: dict) -> None:
            if message["type"] == "http.response.start":
                sent["started"] = True
                code["status"] = message["status"]
            await send(message)

        headers = dict(scope.get("headers") or [])
        try:
            refusal = self._refuse(scope, headers)
            if refusal is not None:
                await refusal(scope, receive, send_wrapper)
            else:
                try:
                    await self.app(scope, body, send_wrapper)
                except Exception:
                    if body.refusal is None:
                        raise
                if body.refusal is not None and not sent["started"]:
                    status, message = body.refusal
                    # Stop reading: the rest of the body is never read; the connection closes.
                    await _error(scope, status, message, {"Connection": "close"})(scope, receive, send_out)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or ("unmatched" if code["status"] in (404, 405) else "other")
            if code["status"] == 401:
                label = "unauthorized"
            self.metrics.requests.labels(route=label, method=scope.get("method", ""), code=str(code["status"])).inc()
            self.metrics.latency.labels(route=label, method=scope.get("method", "")).observe(time.perf_counter() - start)

    def _refuse(self, scope: dict, headers: dict) -> Optional[Response]:
        if self.expected is not None and scope.get("path") != "/health-check":
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(b"Bearer " + token.strip(), self.expected)):
                return JSONResponse({"detail": "missing or invalid bearer token"}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        has_body = b"transfer-encoding" in headers
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return _error(scope, 400, "invalid Content-Length")
            if size > self.max_body_bytes:
                return _error(scope, 413, f"request body over {self.max_body_bytes} bytes", {"Connection": "close"})
            has_body = has_body or size > 0
        content_type = headers.get(b"content-type")
        if has_body and content_type is not None and not _is_json(content_type):
            return _error(scope, 415, f"Content-Type {content_type.decode('latin-1')[:100]!r} is not supported; "
                                      "send application/json")
        return None


def _error(scope: dict, status: int, message: str, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """An error in the shape of the route's API: OpenAI's under /v1/, Cog's (FastAPI's) elsewhere."""
    if str(scope.get("path", "")).startswith("/v1/"):
        kind = "invalid_request_error" if status < 500 else "server_error"
        return _openai_error(status, message, kind=kind, headers=headers)
    return JSONResponse({"detail": message}, status_code=status, headers=headers)


def create_app(core: Core, *, token: Optional[str] = None, grace_s: float = 30.0,
               webhooks: WebhookPolicy = WebhookPolicy(), max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S) -> Any:
    """A FastAPI app (wrapped in the auth/limits/metrics guard) serving ``core``. ``token``: when
    set, every endpoint but ``/health-check`` needs ``Authorization: Bearer <token>``.
    ``webhooks``: which webhook URLs are accepted (default: public addresses only)."""
    Input = core.input_model
    limits = core.limits

    PredictionRequest = create_model(
        "PredictionRequest",
        __config__=ConfigDict(extra="ignore"),  # Cog's director sends more top-level keys over time
        input=(Input, Field(default_factory=Input)),
        id=(Optional[str], Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")),
        created_at=(Optional[str], Field(None, max_length=64)),
        webhook=(Optional[AnyHttpUrl], None),
        webhook_events_filter=(Optional[list[Literal[WEBHOOK_EVENTS]]], Field(None, max_length=4)),  # type: ignore[valid-type]
        output_file_prefix=(Optional[str], Field(None, max_length=1000)),
    )

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

    class ImageGenerationRequest(BaseModel):
        model_config = ConfigDict(extra="ignore")  # OpenAI clients send model/quality/style/user ...
        prompt: Optional[str] = Field(None, max_length=1000)
        n: json_int(1, limits.max_batch_size) = 1  # type: ignore[valid-type]
        size: Optional[str] = Field(None, max_length=32, pattern=r"^(auto|[0-9]{1,5}x[0-9]{1,5})$")
        response_format: Literal["b64_json"] = "b64_json"
        seed: Optional[json_int(0, SEED_MAX - (limits.max_batch_size - 1))] = None  # type: ignore[valid-type]

    class ImageData(BaseModel):
        b64_json: str

    class ImagesResponse(BaseModel):
        created: int
        data: list[ImageData]

    http_metrics = HttpMetrics(core.metrics.registry)
    webhook_tasks: set[asyncio.Task] = set()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state["client"] = delivery_client()
        try:
            yield
        finally:
            if webhook_tasks:  # final webhooks of drained predictions
                await asyncio.wait(list(webhook_tasks), timeout=grace_s)
            await state["client"].aclose()

    app = FastAPI(title="preheat", version=_version(), lifespan=lifespan,
                  description="Diffusion sampling server (Cog- and OpenAI-compatible). Starts hot, batches requests.")

    # ---------------------------------------------------------------- errors: 4xx, never a traceback

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "invalid")), "type": str(e.get("type", "value_error"))}
                  for e in exc.errors()]
        if request.url.path.startswith("/v1/"):
            first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
            fields = [str(p) for p in first["loc"] if p != "body" and not isinstance(p, int)]
            return _openai_error(422, f"{'.'.join(fields) or 'body'}: {first['msg']}", fields[0] if fields else None)
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        if status == 400 and "parsing the body" in str(exc.detail):  # undecodable JSON (e.g. huge ints)
            status = 422
        return JSONResponse({"detail": exc.detail}, status_code=status, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}"}, status_code=500)

    # ---------------------------------------------------------------- shared helpers

    def refusal(err: Exception, openai: bool = False) -> JSONResponse:
        if isinstance(err, QueueFull):  # Cog answers 409 when it cannot take a prediction; OpenAI 429
            headers = {"Retry-After": str(err.retry_after)}
            if openai:
                return _openai_error(429, str(err), kind="rate_limit_error", headers=headers)
            return JSONResponse({"detail": str(err)}, status_code=409, headers=headers)
        assert isinstance(err, NotAccepting)
        headers = {"Retry-After": "5"} if err.reason == "starting" else {}
        if openai:
            return _openai_error(503, str(err), kind="server_error", headers=headers)
        return JSONResponse({"detail": str(err)}, status_code=503, headers=headers)

    async def wait_completed(pred: Prediction, request: Request) -> Optional[dict[str, Any]]:
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

    def webhook_listener(url: str, events: set[str]) -> Any:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                event, snap = await queue.get()
                if event == "abort":  # the prediction was never created
                    return
                if event == "start" and events & {"start", "logs"}:
                    await post_webhook(url, snap, attempts=1)
                if event == "completed":
                    if events & {"completed", "output", "logs"}:
                        await post_webhook(url, snap, attempts=3)
                    return

        task = loop.create_task(deliver())
        webhook_tasks.add(task)
        task.add_done_callback(webhook_tasks.discard)

        def listener(event: str, snap: dict) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (event, snap))

        def abort() -> None:
            queue.put_nowait(("abort", {}))

        return listener, abort

    async def post_webhook(url: str, snap: dict, attempts: int) -> None:
        for attempt in range(attempts):
            try:
                response = await webhooks.post(state["client"], url, snap)  # the checked address, no redirects
                if response.status_code < 500:
                    return
            except WebhookRefused as err:  # DNS changed since the prediction was accepted
                log.warning("webhook %s refused: %s", url, err)
                return
            except httpx.HTTPError as err:
                log.warning("webhook %s failed: %s", url, err)
            if attempt + 1 < attempts:
                await asyncio.sleep(0.5 * 2**attempt)

    def conflict(pid: str) -> JSONResponse:
        return JSONResponse({"detail": f"prediction {pid} exists with a different input"}, status_code=409)

    def same_input(existing: Prediction, body: Any) -> bool:
        """Whether a retry asks for the existing prediction (raises ``InputError`` when invalid)."""
        if existing.input == body.input.model_dump(exclude_unset=True):
            return True
        return core.same_request(existing, body.input)

    async def attach(pred: Prediction, respond_async: bool, request: Request) -> Response:
        if respond_async:
            return JSONResponse(core.snapshot(pred), status_code=202)
        snap = await wait_completed(pred, request)
        if snap is None:
            return JSONResponse({"detail": "the client went away"}, status_code=499)
        return JSONResponse(snap)

    async def predict(body: Any, prediction_id: Optional[str], prefer: Optional[str], request: Request) -> Response:
        respond_async = _wants_async(prefer)
        pid = prediction_id or body.id
        existing = core.get(pid) if pid else None
        if existing is not None:  # an idempotent retry: attach to it (running or finished)
            try:
                if not same_input(existing, body):
                    return conflict(pid)
            except InputError as err:
                return JSONResponse({"detail": _detail(err.errors)}, status_code=422)
            return await attach(existing, respond_async, request)
        try:
            job, given = core.parse(body.input)
        except InputError as err:
            return JSONResponse({"detail": _detail(err.errors)}, status_code=422)
        except NotAccepting as err:
            return refusal(err)
        extra: dict[str, Any] = {}
        listener, abort = None, None
        if body.webhook is not None:
            try:
                await webhooks.resolve(str(body.webhook))  # refused before anything is sent anywhere
            except WebhookRefused as err:
                return JSONResponse({"detail": _detail([("webhook", str(err))], ("body",))}, status_code=422)
            events = set(body.webhook_events_filter) if body.webhook_events_filter is not None else set(WEBHOOK_EVENTS)
            extra = {"webhook": str(body.webhook), "webhook_events_filter": sorted(events)}
            listener, abort = webhook_listener(str(body.webhook), events)
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
            if not same_input(pred, body):
                return conflict(pid)
        return await attach(pred, respond_async, request)

    # ---------------------------------------------------------------- Cog routes

    @app.get("/", include_in_schema=False)
    async def root() -> dict[str, Any]:
        return {"docs_url": "/docs", "openapi_url": "/openapi.json"}

    @app.get("/health-check", summary="Health check (never needs a token)")
    async def health_check() -> dict[str, Any]:
        status = core.status
        out: dict[str, Any] = {"status": status, "setup": core.setup.as_dict()}
        if status == "SETUP_FAILED":
            out["error"] = core.setup.error
        if core.draining:
            out["draining"] = True
        out["queue_depth"] = core.queue_depth
        return out

    prediction_responses: dict[int | str, dict[str, Any]] = {
        200: {"model": PredictionResponse}, 202: {"model": PredictionResponse, "description": "Accepted (Prefer: respond-async)"},
        408: {"description": "The body did not arrive in time"},
        409: {"description": "The id exists with a different input, or the queue is full (see Retry-After)"},
        413: {"description": "Body too large"},
        415: {"description": "Body is not JSON"},
        422: {"description": "Invalid input; detail names the field"},
        503: {"description": "Starting, set-up failed or draining"},
    }

    @app.post("/predictions", summary="Run a prediction", responses=prediction_responses)
    async def create_prediction(raw: Request, request: PredictionRequest = Body(default_factory=PredictionRequest),  # type: ignore[valid-type]
                                prefer: Optional[str] = Header(default=None)) -> Response:
        return await predict(request, None, prefer, raw)

    @app.put("/predictions/{prediction_id}", summary="Run a prediction, idempotently by id", responses=prediction_responses)
    async def put_prediction(raw: Request,
                             prediction_id: str = Path(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$"),
                             request: PredictionRequest = Body(default_factory=PredictionRequest),  # type: ignore[valid-type]
                             prefer: Optional[str] = Header(default=None)) -> Response:
        if request.id is not None and request.id != prediction_id:
            return JSONResponse({"detail": _detail([("id", "prediction ID must match the ID supplied in the URL")],
                                                   ("body",))}, status_code=422)
        return await predict(request, prediction_id, prefer, raw)

    @app.get("/predictions/{prediction_id}", summary="Current state of a prediction (extension)",
             responses={200: {"model": PredictionResponse}, 404: {"description": "Unknown id"}})
    async def get_prediction(prediction_id: str = Path(..., min_length=1, max_length=128)) -> Response:
        pred = core.get(prediction_id)
        if pred is None:
            return JSONResponse({"detail": "prediction not found"}, status_code=404)
        return JSONResponse(core.snapshot(pred))

    @app.post("/predictions/{prediction_id}/cancel", summary="Cancel a prediction",
              responses={404: {"description": "Unknown id"}})
    async def cancel_prediction(prediction_id: str = Path(..., min_length=1, max_length=128)) -> Response:
        if not core.cancel(prediction_id):
            return JSONResponse({}, status_code=404)
        return JSONResponse({}, status_code=200)

    # ---------------------------------------------------------------- OpenAI-style route

    @app.post("/v1/images/generations", summary="OpenAI-style image generation", response_model=None,
              responses={200: {"model": ImagesResponse}, 408: {"description": "The body did not arrive in time"},
                         413: {"description": "Body too large"}, 415: {"description": "Body is not JSON"},
                         422: {"description": "Invalid request"}, 429: {"description": "Queue full; see Retry-After"},
                         503: {"description": "Not ready, or shutting down"}})
    async def images_generations(raw_request: Request, request: ImageGenerationRequest) -> Response:
        raw: dict[str, Any] = {"num_outputs": request.n, "output_format": "png"}
        if request.prompt is not None:
            raw["prompt"] = request.prompt
        if request.seed is not None:
            raw["seed"] = request.seed
        if request.size is not None and request.size != "auto":
            w, h = (int(v) for v in request.size.split("x"))
            raw["width"], raw["height"] = w, h
        try:
            job, given = core.parse(raw)
        except InputError as err:
            field, message = err.errors[0]
            param = _OPENAI_FIELDS.get(field, field)
            if param == "size":
                sizes = ", ".join(f"{w}x{h}" for w, h in _served_sizes(core.pipe, core.limits))
                message = f"size must be one of {sizes}"
            return _openai_error(422, f"{param}: {message}", param)
        except NotAccepting as err:
            return refusal(err, openai=True)
        try:
            pred, _ = core.submit(job, given)
        except (QueueFull, NotAccepting) as err:
            return refusal(err, openai=True)
        snap = await wait_completed(pred, raw_request)
        if snap is None:
            return _openai_error(499, "the client went away")
        if snap["status"] == "failed" and snap["error"] == SHUT_DOWN:  # dropped by a drain: as new requests are
            return _openai_error(503, f"the server is shutting down: {SHUT_DOWN}", kind="server_error")
        if snap["status"] != "succeeded":
            return _openai_error(500, f"generation {snap['status']}: {snap['error'] or ''}".strip(), kind="server_error")
        data = [{"b64_json": url.partition(",")[2]} for url in snap["output"]]
        return JSONResponse({"created": int(time.time()), "data": data})

    # ---------------------------------------------------------------- metrics

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(http_metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---------------------------------------------------------------- OpenAPI: the model's own choices

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, plus (once the model is loaded) what only the model knows: its
        classes and its image size, as enums, so that schema-valid input is accepted input."""
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        if core.setup.status == "succeeded":
            _describe_model(spec, core.pipe, core.samplers, core.limits)
            app.openapi_schema = spec  # final: cache it
        return spec

    app.openapi = openapi  # type: ignore[method-assign]

    guarded = _Guard(app, token or None, http_metrics, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    guarded.fastapi = app  # type: ignore[attr-defined]
    return guarded


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read: uvicorn's
    ``receive`` then blocks until ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _served_sizes(pipe: Any, limits: Any) -> tuple[tuple[int, int], ...]:
    """(width, height) pairs a request may ask for: the served sizes, or the model's only size."""
    if "prompt" in pipe.family.inputs:
        from preheat.server.inputs import default_size

        return tuple(limits.sizes) or (default_size(pipe),)
    return ((pipe.sample_shape[1], pipe.sample_shape[0]),)


def _describe_model(spec: dict[str, Any], pipe: Any, samplers: tuple[str, ...] = (), limits: Any = None) -> None:
    schemas = spec.get("components", {}).get("schemas", {})
    sizes = _served_sizes(pipe, limits)
    widths = sorted({w for w, _ in sizes})
    heights = sorted({h for _, h in sizes})
    null = {"type": "null"}
    text = "prompt" in pipe.family.inputs
    negative: dict[str, Any] = {"anyOf": [null], "description": "Not used: the model has no text encoder."}
    if text:
        class_label = {"anyOf": [null], "description": "Not used: this is a text-to-image model."}
        prompt = {"anyOf": [{"type": "string", "maxLength": 2000}], "description": "What to draw (required)."}
        negative = {"anyOf": [{"type": "string", "maxLength": 2000}, null],
                    "description": "What to steer away from (needs guidance_scale != 1)."}
    elif pipe.num_classes is not None:
        names = list(pipe.labels) or [str(i) for i in range(pipe.num_classes)]
        class_label = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": pipe.num_classes - 1},
                                 {"type": "string", "enum": names}, null]}
        prompt = {"anyOf": [{"type": "string", "enum": names}, null],
                  "description": "The class to draw, by name (this model is class-conditional)."}
    else:
        class_label = {"anyOf": [null], "description": "Not used: the model is unconditional."}
        prompt = {"anyOf": [{"type": "string", "enum": [""]}, null], "description": "Not used: the model is unconditional."}
    model_input = schemas.get("Input", {}).get("properties", {})
    if model_input:
        model_input["class_label"] = {**class_label, "title": "Class Label", "x-order": 1}
        model_input["prompt"] = {**prompt, "title": "Prompt", "x-order": 0}
        model_input["negative_prompt"] = {**negative, "title": "Negative Prompt", "x-order": 1}
        model_input["width"] = {"anyOf": [{"type": "integer", "enum": widths}, null], "title": "Width", "x-order": 7}
        model_input["height"] = {"anyOf": [{"type": "integer", "enum": heights}, null], "title": "Height", "x-order": 8}
        if samplers:  # what warm-up compiled; every other sampler is refused
            model_input["scheduler"] = {"anyOf": [{"type": "string", "enum": list(samplers)}, null],
                                        "title": "Scheduler", "x-order": 5,
                                        "description": "Sampler (the model's default when absent)."}
    openai = schemas.get("ImageGenerationRequest", {}).get("properties", {})
    if openai:
        openai["prompt"] = {**prompt, "title": "Prompt"}
        openai["size"] = {"anyOf": [{"type": "string", "enum": [*(f"{w}x{h}" for w, h in sizes), "auto"]}, null],
                          "title": "Size"}


def _version() -> str:
    from preheat._version import __version__

    return __version__
