"""The system-under-test contract, and the open-loop driver shared by step-based engines."""

from __future__ import annotations

import abc
from collections import deque
from typing import Any, Sequence

from servelab.bench.metrics import RequestRecord
from servelab.bench.workload import BenchRequest, TokenSpace
from servelab.core.clock import Clock, WallClock


class System(abc.ABC):
    """A serving system the harness measures: servelab in process, an HTTP server, or a
    baseline engine. ``space`` describes its model for building the workload;
    ``simulated`` is True when its times are virtual (``executor=simulated``)."""

    name: str
    space: TokenSpace
    simulated: bool = False

    @abc.abstractmethod
    def run(self, requests: Sequence[BenchRequest], progress: Any = None) -> tuple[list[RequestRecord], dict[str, Any]]:
        """Send every request at its arrival offset and wait for all of them; returns one
        record per request and system statistics (KV memory, batches; may be empty).
        ``progress`` (a tqdm bar or None) is advanced once per finished request."""

    def close(self) -> None:
        """Release the system's resources."""


class SteppedSystem(System):
    """An engine driven step by step in this process (open loop).

    The driver adds every request whose arrival time has come, with that scheduled time
    as its arrival (so time spent waiting for a running step counts as queueing), steps
    the engine while it has work, and sleeps until the next arrival when it is idle. Time
    is the system's ``clock``: the engine's, virtual under ``executor=simulated``.
    """

    clock: Clock = WallClock()

    @abc.abstractmethod
    def add(self, request: BenchRequest, arrival_time: float) -> RequestRecord | None:
        """Queue ``request``, arrived at ``arrival_time`` (seconds on ``clock``); returns a
        failed record instead when the engine rejects it."""

    @abc.abstractmethod
    def step(self) -> list[RequestRecord]:
        """Run one step; records of the requests that finished in it."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """True while any added request is unfinished."""

    def begin(self) -> None:
        """Called before the measured requests (start collecting statistics)."""

    def end(self) -> dict[str, Any]:
        """Called after them; the statistics collected since ``begin``."""
        return {}

    def run(self, requests: Sequence[BenchRequest], progress: Any = None) -> tuple[list[RequestRecord], dict[str, Any]]:
        """Drive the engine through ``requests`` (see the class docstring)."""
        pending = deque(sorted(requests, key=lambda r: r.arrival_offset_s))
        records: list[RequestRecord] = []
        self.begin()
        clock = self.clock
        try:
            start = clock.now()
            while pending or self.has_work():
                now = clock.now()
                while pending and start + pending[0].arrival_offset_s <= now:
                    request = pending.popleft()
                    rejected = self.add(request, start + request.arrival_offset_s)
                    if rejected is not None:
                        self._collect(records, [rejected], progress)
                if self.has_work():
                    self._collect(records, self.step(), progress)
                elif pending:
                    clock.advance_to(start + pending[0].arrival_offset_s)
        finally:
            stats = self.end()
        return records, stats

    @staticmethod
    def _collect(records: list[RequestRecord], finished: list[RequestRecord], progress: Any) -> None:
        records += finished
        if progress is not None and finished:
            progress.update(len(finished))
