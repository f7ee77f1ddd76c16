"""The outermost ASGI layer of the server's app: bearer-token auth, body limits, HTTP metrics.

Limits enforced here, for every transfer encoding: the body is counted while it streams in and
reading stops at ``max_body_bytes`` (413); a body must arrive within ``body_timeout_s`` of the
request's first read (408); a body that is not JSON is refused (415), but for the multipart
routes (``MULTIPART_PATHS``: OpenAI's edits), which take only multipart/form-data. Header read timeouts live
in the protocol (``preheat.server.serve``).
"""

import asyncio
import hmac
import time
from typing import Any, Optional

from fastapi.responses import JSONResponse, Response

from preheat.server.metrics import HttpMetrics

__all__ = ["Guard", "MAX_BODY_BYTES", "BODY_TIMEOUT_S", "api_error", "openai_error"]

MAX_BODY_BYTES = 1 << 20
# Served without the token: health, and the playground page (a constant that holds nothing of the
# model; it asks for the token itself) and the redirect to it.
OPEN_PATHS = ("/health-check", "/playground", "/")
BODY_TIMEOUT_S = 30.0


def openai_error(status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                  headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status, headers=headers)


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


MULTIPART_PATHS = ("/v1/images/edits",)  # routes whose body is multipart/form-data (preheat.server.edits)


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";")[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


class Guard:
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
                    await api_error(scope, status, message, {"Connection": "close"})(scope, receive, send_out)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or ("unmatched" if code["status"] in (404, 405) else "other")
            if code["status"] == 401:
                label = "unauthorized"
            self.metrics.requests.labels(route=label, method=scope.get("method", ""), code=str(code["status"])).inc()
            self.metrics.latency.labels(route=label, method=scope.get("method", "")).observe(time.perf_counter() - start)

    def _refuse(self, scope: dict, headers: dict) -> Optional[Response]:
        if self.expected is not None and scope.get("path") not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(b"Bearer " + token.strip(), self.expected)):
                return api_error(scope, 401, "missing or invalid bearer token", {"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        has_body = b"transfer-encoding" in headers
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return api_error(scope, 400, "invalid Content-Length")
            if size > self.max_body_bytes:
                return api_error(scope, 413, f"request body over {self.max_body_bytes} bytes", {"Connection": "close"})
            has_body = has_body or size > 0
        content_type = headers.get(b"content-type")
        if scope.get("path") in MULTIPART_PATHS:  # OpenAI's edits: a form with files, never JSON
            if has_body and (content_type or b"").split(b";")[0].strip().lower() != b"multipart/form-data":
                return api_error(scope, 415, "this route takes Content-Type: multipart/form-data")
            return None
        if has_body and content_type is None:  # as any other non-JSON type: the body is not read
            return api_error(scope, 415, "a request body needs Content-Type: application/json")
        if has_body and content_type is not None and not _is_json(content_type):
            return api_error(scope, 415, f"Content-Type {content_type.decode('latin-1')[:100]!r} is not supported; "
                                         "send application/json")
        return None


def api_error(scope: dict, status: int, message: str, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """An error in the shape of the route's API: OpenAI's under /v1/, Cog's (FastAPI's) elsewhere."""
    if str(scope.get("path", "")).startswith("/v1/"):
        kind = "invalid_request_error" if status < 500 else "server_error"
        kind = "authentication_error" if status == 401 else kind
        return openai_error(status, message, kind=kind, headers=headers)
    return JSONResponse({"detail": message}, status_code=status, headers=headers)
