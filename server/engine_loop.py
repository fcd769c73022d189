"""The engine side of ``servelab-serve``: steps one ``LLMEngine`` and trades messages with
the server over a pipe.

It runs in the engine process (``engine_process.py``), so the HTTP side never holds the
interpreter lock the engine needs, nor takes the cores its threads compute on. The
messages are the frozen dataclasses of ``server/messages.py``.

The engine's ``role`` decides what the loop does with a request. ``mixed`` runs it from
prompt to end. ``prefill`` runs it to its first token, reports that token (so the client
gets it from here), then hands its KV cache off through the ``kv_transfer`` connector and
tells the server (``HandedOff``). ``decode`` admits handed-off requests in the order they
came, each as soon as its cache has room, and streams the rest, after what the prefill
instance sent; one whose KV could never fit is answered with an error.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from servelab.core.errors import InvalidRequestError
from servelab.core.hookspecs import hookimpl
from servelab.core.kv_transfer import KVTransfer, KVTransferError
from servelab.core.outputs import RequestOutput
from servelab.core.step_stats import StepStats
from servelab.server.messages import (AbortRequests, AbortTransfers, AddRequest, AdmitHandedOff, EngineFailed,
                                      HandedOff, LoRAUpdated, RequestAdded, RequestFailed, StepReport, StopEngine,
                                      UpdateLoRA)

log = logging.getLogger(__name__)


class EngineLoop:
    """Runs commands from the connection between engine steps; blocks on the connection
    while the engine is idle, so an idle server costs nothing. ``connector`` moves KV
    caches for an engine whose ``role`` is prefill or decode. Under a router that reads
    cache events (``router=kv_aware``) each report carries the prefix cache's."""

    def __init__(self, engine: Any, conn: Any, connector: KVTransfer | None = None):
        self.engine = engine
        self.conn = conn
        self.role = engine.cfg.get("role", "mixed")
        if self.role != "mixed" and connector is None:
            raise ValueError(f"a {self.role} engine loop needs a kv_transfer connector")
        self.connector = connector
        self._admitting: collections.deque[AdmitHandedOff] = collections.deque()
        self._stats: list[StepStats] = []
        self._aborted: list[str] = []
        self._observer = _StepCollector(engine, self._stats)
        router = engine.cfg.get("router")
        if router is not None and engine.registry.spec_for_config("router", router).cls.uses_cache_events:
            engine.cache.start_events()

    def run(self) -> None:
        """Serve until the stop command or the server's end of the pipe closes. A failing
        step is reported once; after it, every add is refused until stop."""
        engine = self.engine
        engine.registry.plugin_manager.register(self._observer)
        try:
            while self._run_commands(block=not engine.has_unfinished_requests()):
                self._admit_handed_off()
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    handed_off = self._hand_off_prefilled()  # first, so that the report counts the freed blocks
                    self._report(outputs)  # then the first tokens, before the server moves the requests on
                    for message in handed_off:
                        self.conn.send(message)
                elif self._aborted:
                    self._report([])
        except (EOFError, OSError):  # the server went away
            pass
        except Exception as exc:  # a bug in the engine: the server fails every request
            log.exception("the engine loop failed")
            self.conn.send(EngineFailed(repr(exc)))
            self._refuse_until_stop(repr(exc))
        finally:
            engine.registry.plugin_manager.unregister(self._observer)
            for command in self._admitting:
                self._drop(command.tickets)
            if self.connector is not None:
                self.connector.shutdown()
            engine.shutdown()

    def _run_commands(self, block: bool) -> bool:
        """Run the waiting commands (first waiting for one when ``block``); False on stop."""
        if block:
            self.conn.poll(None)
        while self.conn.poll(0):
            command = self.conn.recv()
            if isinstance(command, StopEngine):
                return False
            if isinstance(command, AddRequest):
                self._add(command)
            elif isinstance(command, AbortRequests):
                self._abort(list(command.request_ids))
            elif isinstance(command, AdmitHandedOff):
                self._admitting.append(command)
            elif isinstance(command, AbortTransfers):
                self._drop(command.tickets)
            elif isinstance(command, UpdateLoRA):
                self._update_lora(command)
        return True

    def _add(self, command: AddRequest) -> None:
        engine = self.engine
        request_id, prompt, params = command.request_id, command.prompt, command.params
        try:
            engine.add_request(prompt, params, request_id, arrival_time=command.arrival_time, output_kind="delta",
                               max_tokens_must_fit=True, metadata=command.metadata, lora=command.lora,
                               cache_salt=command.cache_salt)
        except InvalidRequestError as exc:
            self.conn.send(RequestAdded(request_id, 0, exc))
        else:
            self.conn.send(RequestAdded(request_id, engine.outputs.groups[request_id].children[0].num_prompt_tokens))

    def _update_lora(self, command: UpdateLoRA) -> None:
        source = None
        try:
            if command.load:
                self.engine.load_lora_adapter(command.name, command.path)
                source = self.engine.lora_adapters()[command.name]
            else:
                self.engine.unload_lora_adapter(command.name)
        except InvalidRequestError as exc:
            self.conn.send(LoRAUpdated(command.command_id, exc))
        else:
            self.conn.send(LoRAUpdated(command.command_id, source=source))

    def _abort(self, request_ids: list[str]) -> None:
        groups = self.engine.outputs.groups
        self._aborted += [r for r in request_ids if r in groups for _ in groups[r].children]
        self.engine.abort_request(request_ids)
        aborted = set(request_ids)
        for command in [c for c in self._admitting if c.request_id in aborted]:
            self._admitting.remove(command)
            self._drop(command.tickets)
            self._aborted += [command.request_id] * len(command.tickets)

    def _hand_off_prefilled(self) -> list[HandedOff | RequestFailed]:
        """Prefill role: hand off every request whose prefill is done; the messages that
        tell the server."""
        if self.role != "prefill":
            return []
        messages: list[HandedOff | RequestFailed] = []
        for request_id in self.engine.ready_to_hand_off():
            try:
                messages.append(HandedOff(request_id, self.engine.hand_off(request_id, self.connector)))
            except KVTransferError as exc:  # the request stays here: answer it with the error
                log.error("hand-off of %s failed: %s", request_id, exc)
                self.engine.abort_request(request_id)
                messages.append(RequestFailed(request_id, exc))
        return messages

    def _admit_handed_off(self) -> None:
        """Decode role: admit the handed-off requests that fit, oldest first; one that
        cannot fit even with nothing else running is answered with an error."""
        engine = self.engine
        while self._admitting:
            command = self._admitting[0]
            try:
                admitted = engine.admit_handed_off(command.tickets, self.connector, output_kind="delta")
                if admitted is None and not engine.has_unfinished_requests():
                    raise InvalidRequestError("prompt", self._never_fits(command))
            except (InvalidRequestError, KVTransferError) as exc:
                self._admitting.popleft()
                self._drop(command.tickets)
                self.conn.send(RequestFailed(command.request_id, exc))
                continue
            if admitted is None:
                return  # wait for steps to free blocks
            self._admitting.popleft()

    def _never_fits(self, command: AdmitHandedOff) -> str:
        cache = self.engine.cache
        blocks = sum(ticket.num_blocks for ticket in command.tickets)
        return (f"the KV cache of its {len(command.tickets)} sequence(s) takes {blocks} blocks of "
                f"cache.block_size={cache.block_size} tokens, more than the decode instance's cache holds "
                f"({cache.usage.total_blocks} blocks)")

    def _drop(self, tickets: Any) -> None:
        for ticket in tickets:
            self.connector.abort(ticket)

    def _report(self, outputs: list[RequestOutput]) -> None:
        """Send the outputs (logprob tokens decoded here, where the tokenizer is warm)
        with the statistics gathered since the last report."""
        tokenizer = self.engine.tokenizer
        for output in outputs:
            entries = [entry for completion in output.outputs for entry in completion.logprobs or ()]
            entries += [entry for entry in output.prompt_logprobs or () if entry is not None]
            for entry in entries:
                for logprob in entry.values():
                    if logprob.decoded_token is None:
                        logprob.decoded_token = (tokenizer.decode([logprob.token_id]) if tokenizer is not None
                                                 else str(logprob.token_id))
        scheduler = self.engine.scheduler
        report = StepReport(tuple(outputs), tuple(self._stats), scheduler.num_running, scheduler.num_waiting,
                            self.engine.cache.usage, tuple(self._aborted), tuple(self.engine.cache.take_events()),
                            self.engine.executor.lora_stats() if self.engine.lora is not None else None)
        self._stats.clear()
        self._aborted.clear()
        self.conn.send(report)

    def _refuse_until_stop(self, reason: str) -> None:
        """After a failure: answer adds with an error until told to stop."""
        try:
            while not isinstance(command := self.conn.recv(), StopEngine):
                if isinstance(command, AddRequest):
                    self.conn.send(RequestAdded(command.request_id, 0, RuntimeError(f"the engine loop failed: {reason}")))
        except (EOFError, OSError):
            pass


class _StepCollector:
    """The ``servelab_step_end`` hook implementation gathering one engine's step stats."""

    def __init__(self, engine: Any, stats: list[StepStats]):
        self.engine = engine
        self.stats = stats

    @hookimpl
    def servelab_step_end(self, engine: Any, stats: Any) -> None:
        """Keep the step's stats if it belongs to the served engine."""
        if engine is self.engine:
            self.stats.append(stats)
