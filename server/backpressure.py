"""Backpressure: how much work the server holds for its engine, and for how long.

``server.max_queued_requests`` bounds the engine requests (one per prompt of an API
call) accepted and not finished, waiting or running: past it a new completion call is
answered 429 with ``Retry-After`` at once, before anything enters the engine, so a flood
costs the engine nothing and the server's event loop (``/health``, ``/metrics``) stays
free. ``server.request_timeout_s`` bounds how long an accepted call may run: then its
requests are aborted in the engine, which frees their KV blocks, and the call ends with
a 504 (a stream with an error event).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.core.errors import InvalidRequestError
from servelab.server.errors import ErrorBody, QueueFullError, RequestTimeoutError
from servelab.server.metrics import ServerMetrics
from servelab.server.output_stream import OutputStream

if TYPE_CHECKING:
    from servelab.server.async_engine import AsyncEngine

RETRY_AFTER_S = 1
"""The ``Retry-After`` of a 429: requests on this server last seconds, so a slot is
likely free again within one."""

RESPONSES = {
    429: {"model": ErrorBody, "description": "The server holds server.max_queued_requests requests; retry "
          "after Retry-After seconds (code rate_limit_exceeded).",
          "headers": {"Retry-After": {"description": "Seconds to wait before retrying.",
                                      "schema": {"type": "integer"}}}},
    504: {"model": ErrorBody, "description": "The request ran longer than server.request_timeout_s and was "
          "aborted (code request_timeout); a stream ends with this error as an event instead."},
}
"""The OpenAPI ``responses`` of the completion endpoints for backpressure."""


class Backpressure:
    """Admits API calls to one engine while it holds fewer than ``max_queued_requests``
    requests (None: no limit) and times them out after ``request_timeout_s`` seconds
    (None: never); counts both in ``metrics``."""

    def __init__(self, max_queued_requests: int | None, request_timeout_s: float | None, metrics: ServerMetrics):
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.held = 0
        """Engine requests of the open streams: accepted and not finished."""

    def open_stream(self, engine: "AsyncEngine", num_requests: int) -> OutputStream:
        """A stream for an API call of ``num_requests`` engine requests, held until it
        closes. Raises ``QueueFullError`` (429) when they do not fit under the limit now,
        ``InvalidRequestError`` (400) when they never could."""
        limit = self.max_queued_requests
        if limit is not None:
            if num_requests > limit:
                raise InvalidRequestError("prompt", f"has {num_requests} prompts, more than the "
                                          f"server.max_queued_requests={limit} requests the server holds at once")
            if self.held + num_requests > limit:
                self.metrics.rejected.inc()
                raise QueueFullError(limit, RETRY_AFTER_S)
        self.held += num_requests
        stream = engine.open_stream(on_close=lambda: self._release(num_requests))
        if self.request_timeout_s is not None:
            stream.expire_after(self.request_timeout_s, self._timed_out)
        return stream

    def _release(self, num_requests: int) -> None:
        self.held -= num_requests

    def _timed_out(self) -> RequestTimeoutError:
        self.metrics.timed_out.inc()
        return RequestTimeoutError(self.request_timeout_s)
