"""The server's handle on the engine process, used from one asyncio event loop: it admits
API calls, owns their output streams and trades messages with the engine.

Commands go to the engine process through its pipe (``server/messages.py``); a reader
thread receives its messages and hands each to the event loop in one
``loop.call_soon_threadsafe`` call, which settles pending adds, feeds the metrics and
routes each step's delta outputs to the ``OutputStream`` that owns the request.

Admission (docs/server.md): ``server.max_queued_requests`` bounds the engine requests
(one per prompt of an API call) accepted and not finished, waiting or running: past it a
new call is answered 429 with ``Retry-After`` at once, before anything enters the engine,
so a flood costs the engine nothing and the event loop (``/health``, ``/metrics``) stays
free. ``server.request_timeout_s`` bounds how long an accepted call may run: then its
requests are aborted in the engine, which frees their KV blocks, and the call ends with
a 504 (a stream with an error event).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable, TypeVar

from servelab.core.errors import InvalidRequestError
from servelab.core.sampling_params import SamplingParams
from servelab.server.messages import (AbortRequests, AddRequest, EngineFailed, EngineInfo, RequestAdded,
                                      StepReport, StopEngine)
from servelab.server.engine_process import EngineProcess
from servelab.server.errors import (RETRY_AFTER_S, EngineDeadError, QueueFullError, RequestAbortedError,
                                    RequestTimeoutError)
from servelab.server.metrics import ServerMetrics
from servelab.server.output_stream import OutputStream

log = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncEngine:
    """The engine process seen from the event loop: admit API calls (``open_stream``, at
    most ``max_queued_requests`` engine requests held, None: no limit; each call aborted
    after ``request_timeout_s``, None: never), add and abort requests, stream their
    outputs, answer tokenizer questions locally (``call``)."""

    def __init__(self, process: EngineProcess, metrics: ServerMetrics, max_queued_requests: int | None = None,
                 request_timeout_s: float | None = None):
        self.process = process
        self.conn = process.conn
        self.engine: EngineInfo = process.info
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s
        self.held = 0
        """Engine requests of the open streams: accepted and not finished."""
        self.dead: BaseException | None = None
        self._streams: dict[str, OutputStream] = {}
        self._adding: dict[str, asyncio.Future] = {}
        self._idle = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stopping = False
        self.on_failed: Callable[[str], None] | None = None
        """Called once, on the event loop, when the engine fails (the server shuts down)."""

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start receiving from the engine process; call from the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._reader = threading.Thread(target=self._receive, name="servelab-engine-reader", daemon=True)
        self._reader.start()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if ``timeout`` seconds passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def abort_all(self, error: BaseException) -> None:
        """Abort every request in flight; their streams raise ``error``."""
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.fail(error)
        self.abort(list(self._streams))

    async def stop(self) -> None:
        """Abort what is left, stop the engine process and wait for it to exit."""
        if self._reader is None:
            return
        self.abort_all(RequestAbortedError())
        self._stopping = True
        try:
            self.conn.send(StopEngine())
        except OSError:  # already gone
            pass
        await asyncio.to_thread(self.process.join)
        await asyncio.to_thread(self._reader.join)
        self._reader = None

    # -- requests -----------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        """Requests added and not finished yet."""
        return len(self._streams)

    def open_stream(self, num_requests: int = 1) -> OutputStream:
        """A stream for an API call of ``num_requests`` engine requests, held until it
        closes. Raises ``QueueFullError`` (429) when they do not fit under
        ``max_queued_requests`` now, ``InvalidRequestError`` (400) when they never could."""
        limit = self.max_queued_requests
        if limit is not None:
            if num_requests > limit:
                raise InvalidRequestError("prompt", f"has {num_requests} prompts, more than the "
                                          f"server.max_queued_requests={limit} requests the server holds at once")
            if self.held + num_requests > limit:
                self.metrics.rejected.inc()
                raise QueueFullError(limit, RETRY_AFTER_S)
        self.held += num_requests
        stream = OutputStream(self, on_close=lambda: self._release(num_requests))
        if self.request_timeout_s is not None:
            stream.expire_after(self.request_timeout_s, self._timed_out)
        return stream

    def _release(self, num_requests: int) -> None:
        self.held -= num_requests

    def _timed_out(self) -> RequestTimeoutError:
        self.metrics.timed_out.inc()
        return RequestTimeoutError(self.request_timeout_s)

    async def call(self, fn: Callable[[EngineInfo], T]) -> T:
        """``fn(engine info)``: tokenizer work and limits, answered here without a trip to
        the engine process; raises ``EngineDeadError`` once the engine has failed."""
        self._check_alive()
        return fn(self.engine)

    async def add(self, stream: OutputStream, prompt: str | list[int], params: SamplingParams,
                  request_id: str, arrival_time: float) -> int:
        """Validate and queue a request whose outputs go to ``stream``; returns its prompt
        length. Raises ``InvalidRequestError`` (nothing queued) for a bad request (the
        stream's other requests keep running until it closes)."""
        self._check_alive()
        stream.track(request_id)  # before the wait, so that an expiry covers it
        self._streams[request_id] = stream
        self._idle.clear()
        added = self._loop.create_future()
        self._adding[request_id] = added
        try:
            self._send(AddRequest(request_id, prompt, params, arrival_time))
            length = await added
        except BaseException:  # rejected, or cancelled while the engine may have added it
            stream.untrack(request_id)
            self.abort([request_id])
            raise
        finally:
            self._adding.pop(request_id, None)
        self.metrics.prompt_tokens.inc(length)
        return length

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); returns at once."""
        for request_id in request_ids:
            self._forget(request_id)
        if request_ids and self.dead is None and self._reader is not None:
            try:
                self._send(AbortRequests(tuple(request_ids)))
            except EngineDeadError:  # the process is gone with its requests; the reader reports it
                pass

    def _check_alive(self) -> None:
        if self.dead is not None or self._reader is None:
            raise EngineDeadError("the engine is not running" if self.dead is None
                                  else f"the engine loop failed: {self.dead}")

    def _send(self, message: AddRequest | AbortRequests) -> None:
        try:
            self.conn.send(message)
        except OSError as exc:  # the engine process is gone; the reader reports it
            raise EngineDeadError(f"the engine process is gone: {exc!r}") from exc

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    # -- messages from the engine process (reader thread, then the event loop) ----------------
    def _receive(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    code = self.process.exitcode
                    self._loop.call_soon_threadsafe(self._on_failed, f"the engine process exited (code {code})")
                return
            self._loop.call_soon_threadsafe(self._on_message, message)

    def _on_message(self, message: StepReport | RequestAdded | EngineFailed) -> None:
        if isinstance(message, StepReport):
            self._on_report(message)
        elif isinstance(message, RequestAdded):
            future = self._adding.get(message.request_id)
            if future is not None and not future.done():
                if message.error is None:
                    future.set_result(message.prompt_length)
                else:
                    future.set_exception(message.error)
        elif isinstance(message, EngineFailed):
            self._on_failed(message.description)

    def _on_report(self, report: StepReport) -> None:
        metrics = self.metrics
        for stats in report.stats:
            metrics.observe_step(stats)
        metrics.set_gauges(report.num_running, report.num_waiting, report.kv)
        metrics.record_aborted(report.num_aborted)
        for output in report.outputs:
            if output.finished:
                metrics.record_finished(output)
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                self._forget(output.request_id)
            stream.put(output)

    def _on_failed(self, reason: str) -> None:
        """The engine loop failed or its process died: fail every request, then tell
        ``on_failed``."""
        if self.dead is not None:
            return
        log.error("the engine failed: %s", reason)
        self.dead = RuntimeError(reason)
        error = EngineDeadError(f"the engine loop failed: {reason}")
        for future in self._adding.values():
            if not future.done():
                future.set_exception(error)
        self.abort_all(error)
        if self.on_failed is not None:
            self.on_failed(reason)
