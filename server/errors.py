"""Errors in the OpenAI JSON shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from servelab.core.errors import InvalidRequestError

log = logging.getLogger(__name__)

CONTEXT_LENGTH_PHRASE = "maximum context length"


class ErrorDetail(BaseModel):
    """The inside of an OpenAI error body (for the OpenAPI schema)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """An OpenAI error body, ``{"error": {...}}`` (for the OpenAPI schema)."""

    error: ErrorDetail


class APIError(Exception):
    """An error the server answers with ``status``, an OpenAI error body and ``headers``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        """The JSON body: ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as an HTTP response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class EngineDeadError(APIError):
    """503: the engine failed (its loop raised, its process or a parallel worker died);
    the server cannot generate any more and is shutting down."""

    def __init__(self, message: str):
        super().__init__(503, message, "server_error", code="engine_dead")


class RequestAbortedError(APIError):
    """503: the server aborted the request (the shutdown drain timed out)."""

    def __init__(self, message: str = "request aborted: the server is shutting down"):
        super().__init__(503, message, "server_error", code="service_unavailable")


class DeadlineRefusedError(APIError):
    """503: the ``deadline`` policy refused the request: it could no longer be served
    before its ``deadline`` or its ``slo_class``'s first-token target."""

    def __init__(self):
        super().__init__(503, "the engine could not serve this request before its deadline (the deadline field, "
                         "or the first-token target of its slo_class) and refused it; retry with a later deadline "
                         "or a looser slo_class", "server_error", param="deadline", code="deadline_exceeded")


RETRY_AFTER_S = 1
"""The ``Retry-After`` of a 429: requests on this server last seconds, so a slot is
likely free again within one."""


class QueueFullError(APIError):
    """429: the server already holds ``server.max_queued_requests`` requests; the client
    may retry after ``retry_after_s`` seconds (the ``Retry-After`` header). Type and code
    are those of OpenAI's request-rate limits."""

    def __init__(self, limit: int, retry_after_s: int):
        super().__init__(429, f"the server holds its limit of {limit} queued requests "
                         f"(server.max_queued_requests={limit}); retry after {retry_after_s} s",
                         "requests", code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})


class RequestTimeoutError(APIError):
    """504: the request ran longer than ``server.request_timeout_s`` and was aborted."""

    def __init__(self, timeout_s: float):
        super().__init__(504, f"request timed out: it ran longer than server.request_timeout_s={timeout_s:g} "
                         "seconds and was aborted", "server_error", code="request_timeout")


RESPONSES = {
    429: {"model": ErrorBody, "description": "The server holds server.max_queued_requests requests; retry "
          "after Retry-After seconds (code rate_limit_exceeded).",
          "headers": {"Retry-After": {"description": "Seconds to wait before retrying.",
                                      "schema": {"type": "integer"}}}},
    503: {"model": ErrorBody, "description": "The deadline policy refused the request: it could not be served "
          "before its deadline or its slo_class's first-token target (code deadline_exceeded); a stream ends with "
          "this error as an event instead. Also the answer of a draining server."},
    504: {"model": ErrorBody, "description": "The request ran longer than server.request_timeout_s and was "
          "aborted (code request_timeout); a stream ends with this error as an event instead."},
}
"""The OpenAPI ``responses`` of the completion endpoints for admission (``AsyncEngine``)."""


def shutting_down() -> APIError:
    """503: the server is draining and accepts no new work."""
    return APIError(503, "the server is shutting down and accepts no new requests", "server_error",
                    code="service_unavailable")


def from_invalid_request(exc: InvalidRequestError) -> APIError:
    """400 naming the offending field; prompts over the limit get ``context_length_exceeded``."""
    code = "context_length_exceeded" if CONTEXT_LENGTH_PHRASE in str(exc) else "invalid_value"
    return APIError(400, str(exc), param=exc.field, code=code)


def from_validation_error(exc: RequestValidationError) -> APIError:
    """400 for a body that does not parse or does not match the request model (unknown
    fields included); ``param`` is the first offending field."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    messages = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        messages.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return APIError(400, "; ".join(messages) or "invalid request", param=param, code="invalid_value")


def stream_error(exc: Exception) -> dict:
    """The error event that ends a stream whose response already started."""
    if isinstance(exc, APIError):
        return exc.body()
    log.exception("unexpected error while streaming", exc_info=exc)
    return _internal(exc).body()


def _internal(exc: Exception) -> APIError:
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", "server_error", code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error, expected or not, in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return from_invalid_request(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while serving %s", request.url.path, exc_info=exc)
        return _internal(exc).response()
