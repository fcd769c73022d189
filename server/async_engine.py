"""Drives one ``LLMEngine`` on its own thread for an asyncio server.

The engine is not thread-safe, so only the engine thread touches it (and its tokenizer).
The asyncio side sends commands, plain callables, through a thread-safe queue and awaits
their results through futures; each step's outputs come back in one
``loop.call_soon_threadsafe`` call and are routed to the ``OutputStream`` that owns each
request. The loop blocks on the queue while the engine is idle, so an idle server costs
nothing.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable, TypeVar

from servelab.core.errors import InvalidRequestError
from servelab.core.outputs import RequestOutput
from servelab.core.sampling_params import SamplingParams
from servelab.server.errors import EngineDeadError, RequestAbortedError
from servelab.server.metrics import ServerMetrics
from servelab.server.output_stream import OutputStream

log = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()


class AsyncEngine:
    """An ``LLMEngine`` on a dedicated thread, used from one asyncio event loop."""

    def __init__(self, engine: Any, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.dead: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # touched on the event loop only
        self._idle = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle (event loop) ---------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="servelab-engine", daemon=True)
        self._thread.start()

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
        """Abort what is left, stop the engine thread and shut the engine down."""
        if self._thread is None:
            return
        self.abort_all(RequestAbortedError())
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.metrics.close()

    # -- requests (event loop) ----------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        """Requests added and not finished yet."""
        return len(self._streams)

    def open_stream(self) -> OutputStream:
        """A new stream to add one API call's prompts to."""
        return OutputStream(self)

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; return its result or raise
        its exception here."""
        if self.dead is not None or self._thread is None:
            raise EngineDeadError("the engine is not running" if self.dead is None
                                  else f"the engine loop failed: {self.dead!r}")
        loop = self._loop
        future = loop.create_future()

        def command(engine: Any) -> None:
            try:
                if self.dead is not None:
                    raise EngineDeadError(f"the engine loop failed: {self.dead!r}")
                result = fn(engine)
            except BaseException as exc:  # handed to the awaiting coroutine
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._commands.put(command)
        return await future

    async def add(self, stream: OutputStream, prompt: str | list[int], params: SamplingParams,
                  request_id: str, arrival_time: float) -> int:
        """Validate and queue a request whose outputs go to ``stream``; returns its prompt
        length. Raises ``InvalidRequestError`` (nothing queued) for a bad request."""
        self._streams[request_id] = stream
        self._idle.clear()
        try:
            return await self.call(lambda engine: self._add(engine, prompt, params, request_id, arrival_time))
        except BaseException:  # rejected, or cancelled while the engine thread may add it
            self.abort([request_id])
            raise

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); returns at once."""
        for request_id in request_ids:
            self._forget(request_id)
        if request_ids and self._thread is not None:
            self._commands.put(lambda engine: self._abort(engine, request_ids))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                self._forget(output.request_id)
            stream.put(output)

    def _fail_all(self, exc: BaseException) -> None:
        self.abort_all(EngineDeadError(f"the engine loop failed: {exc!r}"))

    # -- the engine thread --------------------------------------------------------------------
    def _add(self, engine: Any, prompt: str | list[int], params: SamplingParams, request_id: str,
             arrival_time: float) -> int:
        token_ids = engine.tokenize(prompt)
        engine.check_request(token_ids, params)
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > engine.max_model_len:
            raise InvalidRequestError("max_tokens", (
                f"This model's maximum context length is {engine.max_model_len} tokens. However, you requested "
                f"{len(token_ids) + params.max_tokens} tokens ({len(token_ids)} in the prompt, {params.max_tokens} "
                f"in the completion). Please reduce the length of the prompt or completion."))
        engine.add_request(prompt, params, request_id, arrival_time=arrival_time, output_kind="delta")
        self.metrics.prompt_tokens.inc(len(token_ids))
        return len(token_ids)

    def _abort(self, engine: Any, request_ids: list[str]) -> None:
        groups = engine.outputs.groups
        aborted = sum(len(groups[r].children) for r in request_ids if r in groups)
        engine.abort_request(request_ids)
        self.metrics.record_aborted(aborted)

    def _run(self) -> None:
        engine = self.engine
        try:
            while self._run_commands(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._finish_outputs(outputs)
                    if outputs:
                        self._loop.call_soon_threadsafe(self._deliver, outputs)
                self.metrics.update_gauges(engine)
        except BaseException as exc:  # a bug in the engine: fail every request, stay up for /health
            log.exception("the engine loop failed")
            self.dead = exc
            self._loop.call_soon_threadsafe(self._fail_all, exc)
            self._drain_until_stop()
        finally:
            engine.shutdown()
            self.metrics.update_gauges(engine)

    def _run_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one when ``block``); False on the stop command."""
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if command is _STOP:
                return False
            command(self.engine)
        return True

    def _drain_until_stop(self) -> None:
        """After a failure: keep answering commands (calls fail with ``EngineDeadError``)
        until told to stop."""
        while (command := self._commands.get()) is not _STOP:
            try:
                command(self.engine)
            except Exception:
                log.exception("command failed after the engine loop failed")

    def _finish_outputs(self, outputs: list[RequestOutput]) -> None:
        """Decode logprob tokens (the tokenizer lives on this thread) and record finished
        requests in the metrics."""
        decode = self.engine.tokenizer.decode if self.engine.tokenizer is not None else None
        for output in outputs:
            for completion in output.outputs:
                for entry in completion.logprobs or ():
                    for logprob in entry.values():
                        if logprob.decoded_token is None:
                            logprob.decoded_token = decode([logprob.token_id]) if decode else str(logprob.token_id)
            if output.finished:
                self.metrics.record_finished(output)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
