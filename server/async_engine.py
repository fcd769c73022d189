"""The server's handle on the engine process, used from one asyncio event loop: it admits
API calls, owns their output streams and trades messages with the engine.

Commands go to the engine process through its pipe (``server/messages.py``); a reader
thread receives its messages and hands each to the event loop in one
``loop.call_soon_threadsafe`` call, which settles pending adds, feeds the metrics and
routes each step's delta outputs to the ``OutputStream`` that owns the request.

A disaggregated deployment has several engine processes: a request is added to a
prefill instance, and when that instance hands it off (``HandedOff``) its tickets go on
to a decode instance, which streams the outputs from the first token. The ``routers``
choose the instance of each pool; aborts go to the instance that holds the request.

Admission (docs/server.md): ``server.max_queued_requests`` bounds the engine requests
(one per prompt of an API call) accepted and not finished, waiting or running: past it a
new call is answered 429 with ``Retry-After`` at once, before anything enters the engine,
so a flood costs the engine nothing and the event loop (``/health``, ``/metrics``) stays
free. ``server.request_timeout_s`` bounds how long an accepted call may run: then its
requests are aborted in the engine, which frees their KV blocks, and the call ends with
a 504 (a stream with an error event). A request the ``deadline`` policy refuses
(finish reason ``deadline``, no tokens) ends its call with a 503 the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import Any, Callable, TypeVar

from servelab.core.errors import InvalidRequestError
from servelab.core.outputs import RequestOutput
from servelab.core.request_metadata import NO_METADATA, RequestMetadata
from servelab.core.sampling_params import SamplingParams
from servelab.core.kv_cache import KVCacheUsage, apply_cache_events
from servelab.core.router import ReplicaState, Router
from servelab.server.messages import (AbortRequests, AbortTransfers, AddRequest, AdmitHandedOff, EngineFailed,
                                      EngineInfo, HandedOff, LoRAUpdated, RequestAdded, RequestFailed, StepReport,
                                      StopEngine, UpdateLoRA)
from servelab.server.engine_process import EngineProcess
from servelab.server.errors import (RETRY_AFTER_S, DeadlineRefusedError, EngineDeadError, QueueFullError,
                                    RequestAbortedError, RequestTimeoutError)
from servelab.server.metrics import ServerMetrics
from servelab.server.output_stream import OutputStream

log = logging.getLogger(__name__)

T = TypeVar("T")

DEADLINE_FINISH_REASON = "deadline"
"""The finish reason of a request the ``deadline`` policy refused."""


class EngineInstance:
    """An ``EngineProcess`` with the requests the server placed on it (``held``: added and
    not yet finished, handed off or aborted) and its latest scheduler and cache gauges."""

    def __init__(self, index: int, process: EngineProcess):
        self.index = index
        self.process = process
        self.name = process.name
        self.held = 0
        self.num_running = 0
        self.num_waiting = 0
        self.kv: KVCacheUsage | None = None
        self.cached_blocks: set[int] = set()
        """The prefix cache's blocks (chained hashes), from its cache events."""

    def send(self, message: Any) -> None:
        """Send a command down the pipe (``OSError`` once the process is gone)."""
        self.process.conn.send(message)

    def observe(self, report: StepReport) -> None:
        """Keep the gauges of a step report and the blocks its cache events leave cached."""
        self.num_running, self.num_waiting = report.num_running, report.num_waiting
        if report.kv is not None:
            self.kv = report.kv
        if report.cache_events:
            apply_cache_events(self.cached_blocks, report.cache_events)

    def state(self, index: int) -> ReplicaState:
        """What a router sees of this instance as replica ``index`` of its pool: the
        requests placed on it (exact, unlike the gauges of its last report) and its KV
        occupancy."""
        return ReplicaState(index, self.held, 0, self.kv.usage if self.kv is not None else 0.0)


def combined_usage(instances: list[EngineInstance]) -> KVCacheUsage | None:
    """The KV occupancy of every instance together (None before any report)."""
    usages = [instance.kv for instance in instances if instance.kv is not None]
    if not usages:
        return None
    return KVCacheUsage(*(sum(getattr(u, name) for u in usages) for name in
                          ("total_slots", "reserved_slots", "used_slots", "total_blocks", "used_blocks",
                           "cached_blocks")))


def refused_by_deadline(output: RequestOutput) -> bool:
    """Whether the ``deadline`` policy refused a sequence of this output (finish reason
    ``deadline``: it could not be served before its deadline or SLO class's first token)."""
    return any(completion.finish_reason == DEADLINE_FINISH_REASON for completion in output.outputs)


class AsyncEngine:
    """The engine process(es) seen from the event loop: admit API calls (``open_stream``, at
    most ``max_queued_requests`` engine requests held, None: no limit; each call aborted
    after ``request_timeout_s``, None: never), add and abort requests, stream their
    outputs, answer tokenizer questions locally (``call``).

    ``processes``: one mixed engine, or the prefill instances then the ``decode`` ones of
    a disaggregated deployment, each pool's instance chosen by its router (``routers``:
    ``{"prefill": ..., "decode": ...}``; needed where a pool has more than one)."""

    def __init__(self, processes: EngineProcess | list[EngineProcess], metrics: ServerMetrics,
                 max_queued_requests: int | None = None, request_timeout_s: float | None = None,
                 decode: list[EngineProcess] = (), routers: dict[str, Router] | None = None):
        processes = [processes] if isinstance(processes, EngineProcess) else list(processes)
        self.entry = [EngineInstance(i, p) for i, p in enumerate(processes)]
        self.decode = [EngineInstance(len(processes) + i, p) for i, p in enumerate(decode)]
        self.instances = self.entry + self.decode
        self.routers = routers or {}
        for pool, members in (("prefill", self.entry), ("decode", self.decode)):
            if len(members) > 1 and pool not in self.routers:
                raise ValueError(f"{len(members)} {pool} instances need a router")
        self.engine: EngineInfo = processes[0].info
        self.lora_adapters: dict[str, str] = dict(self.engine.lora_adapters)
        """The LoRA adapters every instance serves: name to folder."""
        self._lora_updates: dict[tuple[int, int], asyncio.Future] = {}
        self._lora_commands = itertools.count()
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s
        self.held = 0
        """Engine requests of the open streams: accepted and not finished."""
        self.dead: BaseException | None = None
        self._streams: dict[str, OutputStream] = {}
        self._placed: dict[str, EngineInstance] = {}
        self._adding: dict[str, asyncio.Future] = {}
        self._idle = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._readers: list[threading.Thread] = []
        self._stopping = False
        self.on_failed: Callable[[str], None] | None = None
        """Called once, on the event loop, when the engine fails (the server shuts down)."""

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start receiving from the engine process; call from the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._idle.set()
        for instance in self.instances:
            reader = threading.Thread(target=self._receive, args=(instance,), name=f"servelab-{instance.name}-reader",
                                      daemon=True)
            reader.start()
            self._readers.append(reader)

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
        """Abort what is left, stop the engine processes and wait for them to exit."""
        if not self._readers:
            return
        self.abort_all(RequestAbortedError())
        self._stopping = True
        for instance in self.instances:
            try:
                instance.send(StopEngine())
            except OSError:  # already gone
                pass
        for instance in self.instances:
            await asyncio.to_thread(instance.process.join)
        for reader in self._readers:
            await asyncio.to_thread(reader.join)
        self._readers = []

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
                  request_id: str, arrival_time: float, metadata: RequestMetadata = NO_METADATA,
                  lora: str | None = None, cache_salt: str | None = None) -> int:
        """Validate and queue a request (with its scheduling ``metadata``, on LoRA adapter
        ``lora`` or the base model, its prefix cached under ``cache_salt``) whose outputs
        go to ``stream``; returns its prompt length. Raises ``InvalidRequestError`` (nothing
        queued) for a bad request (the stream's other requests keep running until it
        closes)."""
        self._check_alive()
        stream.track(request_id)  # before the wait, so that an expiry covers it
        self._streams[request_id] = stream
        self._idle.clear()
        added = self._loop.create_future()
        self._adding[request_id] = added
        tenant = self.metrics.track(request_id, metadata)  # before its outputs can arrive
        try:
            instance = self._choose(self.entry, "prefill", prompt)
            self._place(request_id, instance)
            self._send(instance, AddRequest(request_id, prompt, params, arrival_time, metadata, lora,
                                                 cache_salt))
            length = await added
        except BaseException:  # rejected, or cancelled while the engine may have added it
            stream.untrack(request_id)
            self.abort([request_id])
            raise
        finally:
            self._adding.pop(request_id, None)
        self.metrics.prompt_tokens.labels(tenant=tenant).inc(length)
        return length

    async def update_lora(self, name: str, path: str | None, load: bool = True) -> None:
        """Load the adapter store's adapter at ``path`` (None: the one it serves as
        ``name``) as ``name`` on every instance, or unload ``name`` (``load`` False);
        raises the first instance's ``InvalidRequestError``."""
        self._check_alive()
        command_id = next(self._lora_commands)
        waits = []
        for instance in self.instances:
            waits.append(self._loop.create_future())
            self._lora_updates[(command_id, instance.index)] = waits[-1]
            self._send(instance, UpdateLoRA(command_id, name, path, load))
        try:
            results = await asyncio.gather(*waits)
        finally:
            for instance in self.instances:
                self._lora_updates.pop((command_id, instance.index), None)
        errors = [result.error for result in results if result.error is not None]
        if errors:
            raise errors[0]
        if load:
            self.lora_adapters[name] = results[0].source
        else:
            self.lora_adapters.pop(name, None)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored) on the instances that hold
        them; returns at once."""
        by_instance: dict[int, list[str]] = {}
        for request_id in request_ids:
            instance = self._placed.get(request_id)
            if instance is not None:
                by_instance.setdefault(instance.index, []).append(request_id)
            self._forget(request_id)
        if self.dead is not None or not self._readers:
            return
        for index, ids in by_instance.items():
            try:
                self._send(self.instances[index], AbortRequests(tuple(ids)))
            except EngineDeadError:  # the process is gone with its requests; the reader reports it
                pass

    def _check_alive(self) -> None:
        if self.dead is not None or not self._readers:
            raise EngineDeadError("the engine is not running" if self.dead is None
                                  else f"the engine loop failed: {self.dead}")

    def _send(self, instance: EngineInstance, message: object) -> None:
        try:
            instance.send(message)
        except OSError as exc:  # the engine process is gone; the reader reports it
            raise EngineDeadError(f"the engine process {instance.name} is gone: {exc!r}") from exc

    def _choose(self, pool: list[EngineInstance], name: str, prompt: str | list[int]) -> EngineInstance:
        """The instance of ``pool`` the router picks for a request with this prompt."""
        if len(pool) == 1:
            return pool[0]
        token_ids = prompt if isinstance(prompt, list) else self.engine.tokenizer.encode(prompt)
        return pool[self.routers[name].route(token_ids, [member.state(i) for i, member in enumerate(pool)])]

    def _place(self, request_id: str, instance: EngineInstance | None) -> None:
        """Record that ``instance`` holds the request now (None: no instance does)."""
        previous = self._placed.pop(request_id, None)
        if previous is not None:
            previous.held -= 1
        if instance is not None:
            self._placed[request_id] = instance
            instance.held += 1

    def _forget(self, request_id: str) -> None:
        self._place(request_id, None)
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    # -- messages from the engine processes (reader threads, then the event loop) -------------
    def _receive(self, instance: EngineInstance) -> None:
        while True:
            try:
                message = instance.process.conn.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    code = instance.process.exitcode
                    what = "the engine process" if len(self.instances) == 1 else f"engine instance {instance.name}"
                    self._loop.call_soon_threadsafe(self._on_failed, f"{what} exited (code {code})")
                return
            self._loop.call_soon_threadsafe(self._on_message, instance, message)

    def _on_message(self, instance: EngineInstance, message: object) -> None:
        if isinstance(message, StepReport):
            self._on_report(instance, message)
        elif isinstance(message, RequestAdded):
            future = self._adding.get(message.request_id)
            if message.error is not None:
                self.metrics.forget(message.request_id)
            if future is not None and not future.done():
                if message.error is None:
                    future.set_result(message.prompt_length)
                else:
                    self._place(message.request_id, None)
                    future.set_exception(message.error)
        elif isinstance(message, HandedOff):
            self._on_handed_off(instance, message)
        elif isinstance(message, LoRAUpdated):
            future = self._lora_updates.get((message.command_id, instance.index))
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, RequestFailed):
            stream = self._streams.get(message.request_id)
            self._forget(message.request_id)
            self.metrics.forget(message.request_id)
            if stream is not None:
                stream.fail(message.error)
        elif isinstance(message, EngineFailed):
            self._on_failed(message.description)

    def _on_handed_off(self, prefill: EngineInstance, message: HandedOff) -> None:
        """Send a handed-off request on to a decode instance, or drop its transfers when
        it ended meanwhile."""
        request_id, tickets = message.request_id, message.tickets
        if request_id not in self._streams or not self.decode:
            self._send_or_ignore(prefill, AbortTransfers(tickets))
            return
        handoff = tickets[0].handoff
        decode = self._choose(self.decode, "decode", list(handoff.token_ids[:handoff.num_prompt_tokens]))
        self._place(request_id, decode)
        self._send_or_ignore(decode, AdmitHandedOff(tickets))

    def _send_or_ignore(self, instance: EngineInstance, message: object) -> None:
        try:
            self._send(instance, message)
        except EngineDeadError:  # the reader reports the dead instance, failing its requests
            pass

    def _on_report(self, instance: EngineInstance, report: StepReport) -> None:
        metrics = self.metrics
        for stats in report.stats:
            metrics.observe_step(stats)
        instances = self.instances
        instance.observe(report)
        if len(instances) == 1:
            metrics.set_gauges(report.num_running, report.num_waiting, report.kv)
        else:
            metrics.set_gauges(sum(i.num_running for i in instances), sum(i.num_waiting for i in instances),
                               combined_usage(instances))
        metrics.record_aborted(report.aborted)
        if report.lora is not None:
            metrics.set_lora(instance.index, report.lora)
        if report.cache_events:
            self._route_cache_events(instance, report.cache_events)
        for output in report.outputs:
            metrics.record_output(output)
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                self._forget(output.request_id)
            if refused_by_deadline(output):
                stream.fail(DeadlineRefusedError())
            else:
                stream.put(output)

    def _route_cache_events(self, instance: EngineInstance, events: tuple) -> None:
        """Hand an instance's cache events to its pool's router (indexed within the pool)."""
        name, pool = ("prefill", self.entry) if instance in self.entry else ("decode", self.decode)
        router = self.routers.get(name)
        if router is not None and router.uses_cache_events:
            router.on_cache_events(pool.index(instance), events)

    def _on_failed(self, reason: str) -> None:
        """The engine loop failed or its process died: fail every request, then tell
        ``on_failed``."""
        if self.dead is not None:
            return
        log.error("the engine failed: %s", reason)
        self.dead = RuntimeError(reason)
        error = EngineDeadError(f"the engine loop failed: {reason}")
        for future in (*self._adding.values(), *self._lora_updates.values()):
            if not future.done():
                future.set_exception(error)
        self.abort_all(error)
        if self.on_failed is not None:
            self.on_failed(reason)
