"""The server's errors: `APIError` (an HTTP status and OpenAI's error body), what any exception becomes for the
client, and the handlers that answer every error in the shape of the route's API (Ollama's under /api/)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fsd_local.errors import ConfigError, ContextOverflowError
from fsd_local.server.process_errors import ModelProcessError

log = logging.getLogger("fsd_local.server")


class APIError(Exception):
    """An error answered as HTTP `status` with body {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After (every 503 gets one: RetryAfter)

    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def as_api_error(exc: BaseException) -> APIError:
    """The error a client is told of, for any exception a request or its generation raised."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, ConfigError):
        return APIError(400, str(exc), code="invalid_value")
    if isinstance(exc, ModelProcessError):  # the model process died (500) or will not come back (503)
        log.error("%s", exc)
        return APIError(exc.status, str(exc), type="server_error", code=exc.code)
    log.error("generation failed", exc_info=exc)
    return APIError(500, f"generation failed: {exc}", type="server_error", code="internal_error")


def error_body(path: str, err: APIError) -> dict[str, Any]:
    """An error in the shape of the route's API: Ollama's {"error": "..."} under /api/, else OpenAI's."""
    return {"error": err.message} if path.startswith("/api/") else err.body()


def install(app: FastAPI) -> None:
    """Every error, ours or the framework's, answers with the error body of the route's API; none stops the
    server."""

    def answer(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, err), status_code=err.status, headers=err.headers())

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return answer(request, APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(request, APIError(400, str(exc), code="invalid_value"))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, as_api_error(exc))


class RetryAfter:
    """ASGI middleware adding Retry-After (seconds, from `seconds`) to every 503 that has none."""

    def __init__(self, app: Any, seconds: Callable[[], int]):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def told(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503:
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"retry-after" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"retry-after", str(self.seconds()).encode())]}
            await send(message)

        await self.app(scope, receive, told)
