"""``target=inproc target.replicas=N``: N servelab engines behind a router, simulated.

Each replica is a whole engine (its own scheduler and KV cache) with its own virtual
clock (``executor=simulated``). The driver is a discrete-event loop on one timeline:
the next event is either the next arrival, which the router sends to a replica (an idle
replica's clock catches up to it), or a step of the busy replica whose clock is the
earliest. Routing sees each replica's running and queued requests and KV usage as of
its last step, and a router that reads cache events (``router=kv_aware``) hears each
replica's after each of its steps.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

from omegaconf import DictConfig

from servelab.bench.metrics import RequestRecord
from servelab.bench.step_observer import StepObserver
from servelab.bench.system import System
from servelab.bench.targets.inproc import ServelabSystem
from servelab.bench.workload import BenchRequest
from servelab.core.errors import ConfigError
from servelab.core.router import ReplicaState, RouterContext


class ClusterSystem(System):
    """Replicas of ``ServelabSystem`` behind the configured ``router``."""

    name = "servelab-cluster"
    simulated = True

    def __init__(self, cfg: DictConfig):
        count = cfg.target.replicas
        if count < 1:
            raise ConfigError([f"target.replicas must be >= 1, got {count}"])
        first = ServelabSystem(cfg)
        if not first.simulated:
            first.close()
            raise ConfigError([f"target.replicas={count} runs under executor=simulated (replicas stepped in one "
                               f"process share its cores); serve real replicas with servelab-serve on Ray Serve"])
        self.replicas = [first] + [ServelabSystem(cfg) for _ in range(count - 1)]
        self.space = first.space
        registry = first.engine.registry
        self.router = registry.build("router", cfg.router, RouterContext(count, first.engine.cache.block_size))
        if self.router.uses_cache_events:
            for replica in self.replicas:
                replica.engine.cache.start_events()
        self.observer: StepObserver | None = None

    def states(self) -> list[ReplicaState]:
        """What the router sees of every replica now."""
        return [ReplicaState(i, r.engine.scheduler.num_running, r.engine.scheduler.num_waiting,
                             r.engine.cache.usage.usage) for i, r in enumerate(self.replicas)]

    def run(self, requests: Sequence[BenchRequest], progress: Any = None) -> tuple[list[RequestRecord], dict[str, Any]]:
        """Route and serve every request on the common timeline (see the module docstring)."""
        replicas = self.replicas
        start = max(r.clock.now() for r in replicas)
        for replica in replicas:
            replica.clock.advance_to(start)
            replica.begin()
        self.observer = StepObserver()
        replicas[0].engine.registry.plugin_manager.register(self.observer)
        pending = deque(sorted(requests, key=lambda r: r.arrival_offset_s))
        records: list[RequestRecord] = []
        routed = [0] * len(replicas)
        try:
            while pending or any(r.has_work() for r in replicas):
                busy = [r for r in replicas if r.has_work()]
                earliest = min(busy, key=lambda r: r.clock.now()) if busy else None
                if pending and (earliest is None or start + pending[0].arrival_offset_s <= earliest.clock.now()):
                    request = pending.popleft()
                    arrival = start + request.arrival_offset_s
                    index = self.router.route(request.prompt_token_ids, self.states())
                    routed[index] += 1
                    replica = replicas[index]
                    replica.clock.advance_to(arrival)
                    finished = [] if (rejected := replica.add(request, arrival)) is None else [rejected]
                else:
                    finished = earliest.step()
                    if self.router.uses_cache_events:
                        self.router.on_cache_events(replicas.index(earliest), earliest.engine.cache.take_events())
                records += finished
                if progress is not None and finished:
                    progress.update(len(finished))
        finally:
            replicas[0].engine.registry.plugin_manager.unregister(self.observer)
            per_replica = [{"routed": count, **r.end()} for r, count in zip(replicas, routed)]
        return records, {**self.observer.summary(), "replicas": per_replica}

    def close(self) -> None:
        """Shut every replica down."""
        for replica in self.replicas:
            replica.close()
