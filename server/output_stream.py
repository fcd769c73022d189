"""One API call's stream: the engine outputs of its requests, in the order the engine
produced them, and the ways they reach a client that may go away.

A client that disconnects must not leave its request running: a streamed response is
cancelled by Starlette when the client goes away (and ``EventStreamResponse`` aborts its
requests whatever way it ends); a non-streamed one races the generation against the
connection (``until_disconnected``).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from servelab.core.outputs import RequestOutput

if TYPE_CHECKING:
    from servelab.server.async_engine import AsyncEngine

DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499


class OutputStream:
    """Delta ``RequestOutput``s of the engine requests one API call added
    (``AsyncEngine.add``), in the order the engine produced them.

    Use as ``async with engine.open_stream(n) as stream``: leaving the block (a finished
    response, an error, a client that went away) aborts whatever is still running, which
    frees its KV blocks at once, and calls ``on_close`` (once).
    """

    def __init__(self, engine: "AsyncEngine", on_close: Callable[[], None] | None = None):
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._pending: list[str] = []  # not finished as seen by the consumer
        self._unfinished: set[str] = set()  # not finished as seen by the engine
        self._on_close = on_close
        self._deadline: asyncio.TimerHandle | None = None

    def track(self, request_id: str) -> None:
        """Wait for the outputs of ``request_id`` (the engine is adding it)."""
        self._pending.append(request_id)
        self._unfinished.add(request_id)

    def untrack(self, request_id: str) -> None:
        """Stop waiting for ``request_id`` (the engine refused it)."""
        if request_id in self._pending:
            self._pending.remove(request_id)
        self._unfinished.discard(request_id)

    def expire_after(self, seconds: float, error: Callable[[], BaseException]) -> None:
        """Unless every request of the stream finished within ``seconds``, abort them then
        and end the stream with ``error()``."""
        self._deadline = asyncio.get_running_loop().call_later(seconds, self._expire, error)

    def _expire(self, error: Callable[[], BaseException]) -> None:
        if self._unfinished:
            self.fail(error())
            self._engine.abort(list(self._unfinished))

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand an output (or an error ending the stream) to the consumer."""
        if isinstance(item, RequestOutput) and item.finished:
            self._unfinished.discard(item.request_id)
        self._queue.put_nowait(item)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised by the iterator)."""
        self.put(error)

    def abort(self) -> None:
        """Abort every request of this stream that has not finished and close it: the
        expiry is cancelled and ``on_close`` runs (the first time only)."""
        pending, self._pending = self._pending, []
        self._engine.abort(pending)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self._pending:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished and item.request_id in self._pending:
                self._pending.remove(item.request_id)
            yield item

    async def __aenter__(self) -> "OutputStream":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()


def sse(data: dict) -> str:
    """One server-sent event carrying ``data`` as JSON. Non-ASCII characters are escaped,
    so text holding line separators (U+2028, U+0085, ...) cannot split the event for
    clients that read lines with universal newlines."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response over the chunks of ``events``; when it ends, in
    any way, the requests of ``stream`` still running are aborted."""

    def __init__(self, events: AsyncIterator[str], stream: OutputStream):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.abort()


async def _disconnected(request: Request) -> None:
    """Return once the client closed the connection (the body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` unless the client disconnects first, in which case ``work`` is
    cancelled (its streams abort their requests) and a 499 response is returned."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()
