"""Getting responses to a client that may go away: server-sent events and disconnects.

A client that disconnects must not leave its request running: a streamed response is
cancelled by Starlette when the client goes away (and ``EventStreamResponse`` aborts its
requests whatever way it ends); a non-streamed one races the generation against the
connection (``until_disconnected``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from servelab.server.output_stream import OutputStream

DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499


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
