"""The system-under-test contract, and the open-loop driver shared by step-based engines."""

from __future__ import annotations

import abc
import heapq
import itertools
from typing import Any, Callable, Sequence

from servelab.bench.metrics import RequestRecord
from servelab.bench.workload import BenchRequest, TokenSpace
from servelab.core.clock import Clock, WallClock

FollowUp = Callable[[RequestRecord], "BenchRequest | None"]
"""A closed-loop workload's next request after one finished (``Sessions.follow_up``);
its ``arrival_offset_s`` counts from the run's start like every request's."""


class System(abc.ABC):
    """A serving system the harness measures: servelab in process, an HTTP server, or a
    baseline engine. ``space`` describes its model for building the workload;
    ``simulated`` is True when its times are virtual (``executor=simulated``);
    ``closed_loop`` is True when ``run`` takes a ``follow_up`` (multi-turn, agentic)."""

    name: str
    space: TokenSpace
    simulated: bool = False
    closed_loop: bool = False

    @abc.abstractmethod
    def run(self, requests: Sequence[BenchRequest], progress: Any = None) -> tuple[list[RequestRecord], dict[str, Any]]:
        """Send every request at its arrival offset and wait for all of them; returns one
        record per request and system statistics (KV memory, batches; may be empty).
        ``progress`` (a tqdm bar or None) is advanced once per finished request."""

    def close(self) -> None:
        """Release the system's resources."""


class SteppedSystem(System):
    """An engine driven step by step in this process (open loop, or closed with ``follow_up``).

    The driver adds every request whose arrival time has come, with that scheduled time
    as its arrival (so time spent waiting for a running step counts as queueing), steps
    the engine while it has work, and sleeps until the next arrival when it is idle. Time
    is the system's ``clock``: the engine's, virtual under ``executor=simulated``.
    """

    clock: Clock = WallClock()
    closed_loop = True

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

    def run(self, requests: Sequence[BenchRequest], progress: Any = None,
            follow_up: FollowUp | None = None) -> tuple[list[RequestRecord], dict[str, Any]]:
        """Drive the engine through ``requests`` (see the class docstring), and through the
        request ``follow_up`` returns for each finished one (closed loop)."""
        pending = [(r.arrival_offset_s, i, r) for i, r in enumerate(sorted(requests, key=lambda r: r.arrival_offset_s))]
        order = itertools.count(len(pending))
        records: list[RequestRecord] = []

        def collect(finished: list[RequestRecord]) -> None:
            records.extend(finished)
            if progress is not None and finished:
                progress.update(len(finished))
            for record in finished if follow_up is not None else ():
                if (request := follow_up(record)) is not None:
                    heapq.heappush(pending, (request.arrival_offset_s, next(order), request))

        self.begin()
        clock = self.clock
        try:
            start = clock.now()
            while pending or self.has_work():
                now = clock.now()
                while pending and start + pending[0][0] <= now:
                    request = heapq.heappop(pending)[2]
                    rejected = self.add(request, start + request.arrival_offset_s)
                    if rejected is not None:
                        collect([rejected])
                if self.has_work():
                    collect(self.step())
                elif pending:
                    clock.advance_to(start + pending[0][0])
        finally:
            stats = self.end()
        return records, stats
