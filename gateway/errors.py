"""OpenAI-shaped errors, raised anywhere on the request path and rendered at one boundary (api.py).

    GatewayError              -> {"error": {"message", "type", "param", "code"}} with `status`
     +-- BadRequest            400: malformed JSON, invalid parameters
     +-- Unauthorized          401: missing or wrong gateway API key
     +-- ModelNotFound         404: a model the configuration does not serve
     +-- BodyTooLarge          413: over limits.max_body_bytes
     +-- RateLimited           429: over an admission limit (with Retry-After)
     +-- NoBackend             503: no healthy backend for the model
     +-- UpstreamFailed        502/504: every attempt failed (the body never names a backend URL)

Types and codes follow vLLM's own errors (`code` is the HTTP status), so clients see the same shapes whether
they talk to vLLM directly or through hetgate. Errors the web framework raises itself (404 for an unknown
path, 405, a malformed request to a FastAPI endpoint, an unexpected exception) get the same shape through
the handlers `install_error_handlers` registers.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

log = logging.getLogger("hetgate")

# OpenAI/vLLM error types by status, for errors raised by the framework rather than by hetgate.
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    422: "BadRequestError",
    429: "RateLimitError",
}


class GatewayError(Exception):
    status = 500
    type = "InternalServerError"
    headers: tuple[tuple[bytes, bytes], ...] = ()  # extra response headers (Retry-After)

    def __init__(self, message: str, param: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.type, self.param)


class BadRequest(GatewayError):
    status = 400
    type = "BadRequestError"


class Unauthorized(GatewayError):
    status = 401
    type = "AuthenticationError"


class ModelNotFound(GatewayError):
    status = 404
    type = "NotFoundError"


class BodyTooLarge(GatewayError):
    status = 413
    type = "RequestEntityTooLarge"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_exceeded"

    def __init__(self, message: str, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.reason = reason  # a small fixed set: the admission_rejections metric label
        self.headers = ((b"retry-after", str(max(1, math.ceil(retry_after_s))).encode()),)


class NoBackend(GatewayError):
    status = 503
    type = "ServiceUnavailableError"


class UpstreamFailed(GatewayError):
    status = 502
    type = "BadGatewayError"


def error_body(status: int, message: str, type_: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": status}})


def sse_error_event(message: str, status: int = 502) -> bytes:
    """The in-band error vLLM itself sends when a stream breaks, followed by the end marker."""
    return b"data: " + error_body(status, message, "BadGatewayError") + b"\n\ndata: [DONE]\n\n"


def install_error_handlers(app: FastAPI) -> None:
    """Every error the framework answers by itself becomes an OpenAI-shaped JSON error."""
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)


def _json_error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    type_ = _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    body = error_body(status, message, type_)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


async def _http_error(_request: Request, error: HTTPException) -> Response:
    message = error.detail if isinstance(error.detail, str) else "The request failed."
    return _json_error(error.status_code, message, error.headers)


async def _validation_error(_request: Request, _error: RequestValidationError) -> Response:
    return _json_error(400, "The request is not valid.")


async def _unexpected(_request: Request, error: Exception) -> Response:
    log.error("unexpected %s on a control endpoint", type(error).__name__)  # no request content logged
    return _json_error(500, "Internal server error.")
