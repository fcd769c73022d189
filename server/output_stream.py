"""The engine outputs of one API call, which may hold several prompts."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator

from servelab.core.outputs import RequestOutput
from servelab.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from servelab.server.async_engine import AsyncEngine


class OutputStream:
    """Delta ``RequestOutput``s of the engine requests one API call added, in the order
    the engine produced them.

    Use as ``async with engine.open_stream() as stream``: leaving the block (a finished
    response, an error, a client that went away) aborts whatever is still running, which
    frees its KV blocks at once.
    """

    def __init__(self, engine: "AsyncEngine"):
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._pending: list[str] = []

    async def add(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                  arrival_time: float) -> int:
        """Queue one prompt; returns its length in tokens. Raises ``InvalidRequestError``
        for a bad request (the stream's other requests keep running until it closes)."""
        length = await self._engine.add(self, prompt, params, request_id, arrival_time)
        self._pending.append(request_id)
        return length

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand an output (or an error ending the stream) to the consumer."""
        self._queue.put_nowait(item)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised by the iterator)."""
        self.put(error)

    def abort(self) -> None:
        """Abort every request of this stream that has not finished."""
        pending, self._pending = self._pending, []
        self._engine.abort(pending)

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
