"""The engine outputs of one API call, which may hold several prompts."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator, Callable

from servelab.core.outputs import RequestOutput
from servelab.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from servelab.server.async_engine import AsyncEngine


class OutputStream:
    """Delta ``RequestOutput``s of the engine requests one API call added, in the order
    the engine produced them.

    Use as ``async with engine.open_stream() as stream``: leaving the block (a finished
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

    async def add(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                  arrival_time: float) -> int:
        """Queue one prompt; returns its length in tokens. Raises ``InvalidRequestError``
        for a bad request (the stream's other requests keep running until it closes)."""
        self._pending.append(request_id)  # before the wait, so that an expiry covers it
        self._unfinished.add(request_id)
        try:
            return await self._engine.add(self, prompt, params, request_id, arrival_time)
        except BaseException:
            if request_id in self._pending:
                self._pending.remove(request_id)
            self._unfinished.discard(request_id)
            raise

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
