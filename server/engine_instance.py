"""One engine process as the server's event loop sees it: its pipe, the requests placed on
it and its gauges from the latest report (what a router chooses by)."""

from __future__ import annotations

from typing import Any

from servelab.core.kv_cache import KVCacheUsage
from servelab.core.router import ReplicaState
from servelab.server.engine_process import EngineProcess
from servelab.server.messages import StepReport


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

    def send(self, message: Any) -> None:
        """Send a command down the pipe (``OSError`` once the process is gone)."""
        self.process.conn.send(message)

    def observe(self, report: StepReport) -> None:
        """Keep the gauges of a step report."""
        self.num_running, self.num_waiting = report.num_running, report.num_waiting
        if report.kv is not None:
            self.kv = report.kv

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
