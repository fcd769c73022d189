"""``deployment=disaggregated`` under ``executor=simulated``: prefill and decode pools on
one timeline, each request's KV cache priced across the link between them.

Every instance is a whole engine (``ServelabSystem``: the same scheduler and KV cache a
mixed engine runs) with its own virtual clock; a discrete-event loop keeps them on one
timeline, as ``target.replicas`` does (bench/targets/cluster.py). The next event is the
earliest of: a transfer event, an arrival, or a step of the busy instance whose clock is
the earliest. A request goes through:

1. **Arrival.** The ``router`` picks a prefill instance (an idle one's clock catches up).
2. **Prefill.** After the step that gives it its first token, the prefill instance hands
   it off (``LLMEngine.hand_off`` through ``kv_transfer=simulated``: no bytes, a ticket
   saying how many), freeing its blocks; the router picks a decode instance.
3. **Waiting for room.** The decode instance pulls transfers first come, first served,
   when its free blocks (less those promised to transfers under way) hold the request's
   cached tokens; until then the transfer waits, its KV held by nobody.
4. **Transfer.** ``latency_s + bytes / (bandwidth x streams)`` over ``deployment.link``
   (``KVLink``), one transfer at a time on each instance's link, sender's and receiver's.
5. **Decode.** When the bytes are in, the decode instance admits the request
   (``admit_handed_off``) at its next step boundary; should its cache have filled in the
   meantime, the request waits there for room too. Its outputs carry the prefill's
   timestamps, so TTFT is the first token's, TPOT and TBT include the transfer.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from omegaconf import DictConfig

from servelab.bench.metrics import RequestRecord
from servelab.bench.step_observer import StepObserver
from servelab.bench.system import System
from servelab.bench.targets.inproc import ServelabSystem
from servelab.bench.targets.pools import (ROLES, check_same_blocks, check_simulated, pool_configs, pool_summary,
                                          resolve_link)
from servelab.bench.targets.transfers import Transfer, transfer_summary
from servelab.bench.workload import BenchRequest
from servelab.core.kv_transfer import KVTransferContext, KVTransferError
from servelab.core.router import ReplicaState, RouterContext

READY, ARRIVED = 0, 1
"""Transfer events: a hand-off reaches its decode instance's queue; its bytes arrive."""


@dataclass
class PoolState:
    """One pool: its instances, their router and connectors, and each instance's link
    (busy until ``link_free``) and requests routed."""

    role: str
    instances: list[ServelabSystem]
    router: Any
    connectors: list[Any]
    link_free: list[float] = field(default_factory=list)
    routed: list[int] = field(default_factory=list)

    def states(self, extra: Sequence[int] = ()) -> list[ReplicaState]:
        """What the router sees of every instance; ``extra`` requests each holds outside
        its scheduler (transfers queued or under way)."""
        return [ReplicaState(i, s.engine.scheduler.num_running,
                             s.engine.scheduler.num_waiting + (extra[i] if extra else 0), s.engine.cache.usage.usage)
                for i, s in enumerate(self.instances)]


class DisaggregatedSystem(System):
    """Prefill and decode pools of simulated engines; see the module docstring."""

    name = "servelab-disaggregated"
    simulated = True

    def __init__(self, cfg: DictConfig, base_overrides: Sequence[str] | None = None):
        configs = pool_configs(cfg, base_overrides)
        check_simulated(configs)
        self.link = resolve_link(cfg, configs)
        self.pools: dict[str, PoolState] = {}
        try:
            for role in ROLES:
                self.pools[role] = PoolState(role, [], None, [])
                self._fill(self.pools[role], configs[role], cfg.deployment[role].instances)
            check_same_blocks(self.pools["prefill"].instances[0], self.pools["decode"].instances[0])
        except BaseException:
            self.close()
            raise
        self.space = self.pools["prefill"].instances[0].space
        self._where = {id(s): (role, i) for role, pool in self.pools.items() for i, s in enumerate(pool.instances)}

    @staticmethod
    def _fill(pool: PoolState, cfg: DictConfig, count: int) -> None:
        """Give ``pool`` ``count`` engines of ``cfg`` (each as it is built, so ``close``
        releases them if a later one fails), a connector each and a router over them."""
        for _ in range(count):
            pool.instances.append(ServelabSystem(cfg))
        first = pool.instances[0].engine
        registry = first.registry
        config = registry.get("kv_transfer", "simulated").config_cls()
        pool.connectors += [registry.build("kv_transfer", config, KVTransferContext(f"{pool.role}-{i}", registry))
                            for i in range(count)]
        pool.router = registry.build("router", cfg.router, RouterContext(count, first.cache.block_size))

    def run(self, requests: Sequence[BenchRequest], progress: Any = None) -> tuple[list[RequestRecord], dict[str, Any]]:
        """Serve every request on the common timeline (see the module docstring)."""
        prefill, decode = self.pools["prefill"], self.pools["decode"]
        everyone = prefill.instances + decode.instances
        start = max(s.clock.now() for s in everyone)
        for pool in (prefill, decode):
            pool.link_free = [start] * len(pool.instances)
            pool.routed = [0] * len(pool.instances)
        for instance in everyone:
            instance.clock.advance_to(start)
            instance.begin()
        observer = StepObserver()
        registry = everyone[0].engine.registry
        registry.plugin_manager.register(observer)
        self._events: list[tuple[float, int, int, Transfer]] = []
        self._order = itertools.count()
        self._queued = [deque() for _ in decode.instances]      # handed off, waiting for room
        self._promised = [0] * len(decode.instances)             # blocks of transfers under way
        self._in_flight = [0] * len(decode.instances)
        self._unadmitted: list[deque[Transfer]] = [deque() for _ in decode.instances]
        self._done: list[Transfer] = []
        self._records: list[RequestRecord] = []
        self._progress = progress
        pending = deque(sorted(requests, key=lambda r: r.arrival_offset_s))
        try:
            while True:
                busy = [s for s in everyone if s.has_work()]
                step_at = min((s.clock.now() for s in busy), default=math.inf)
                event_at = self._events[0][0] if self._events else math.inf
                arrival_at = start + pending[0].arrival_offset_s if pending else math.inf
                if event_at == arrival_at == step_at == math.inf:
                    break
                if event_at <= arrival_at and event_at <= step_at:
                    moment, _, kind, transfer = heapq.heappop(self._events)
                    self._on_event(moment, kind, transfer)
                elif arrival_at <= step_at:
                    self._arrive(pending.popleft(), arrival_at)
                else:
                    self._step(min(busy, key=lambda s: s.clock.now()))
        finally:
            registry.plugin_manager.unregister(observer)
            per_instance = {role: [s.end() for s in self.pools[role].instances] for role in ROLES}
        stuck = sum(len(q) for q in self._queued) + sum(len(u) for u in self._unadmitted)
        if stuck:
            raise RuntimeError(f"{stuck} handed-off requests never found room on an idle decode instance")
        end = max(s.clock.now() for s in everyone)
        return self._records, {**observer.summary(), **self._summary(per_instance, end - start)}

    # -- events ---------------------------------------------------------------------------------
    def _finish(self, records: list[RequestRecord]) -> None:
        self._records += records
        if self._progress is not None and records:
            self._progress.update(len(records))

    def _arrive(self, request: BenchRequest, arrival: float) -> None:
        """Route an arrival to a prefill instance and queue it there."""
        pool = self.pools["prefill"]
        index = pool.router.route(request.prompt_token_ids, pool.states())
        pool.routed[index] += 1
        instance = pool.instances[index]
        instance.clock.advance_to(arrival)
        rejected = instance.add(request, arrival)
        if rejected is not None:
            self._finish([rejected])

    def _step(self, instance: ServelabSystem) -> None:
        """One step of ``instance``; a prefill instance then hands off what it prefilled,
        a decode instance admits what waited for room and pulls the next transfers."""
        self._finish(instance.step())
        role, index = self._where[id(instance)]
        if role == "decode":
            self._admit_waiting(index)
            self._pull(index, instance.clock.now())
            return
        prefill, decode = self.pools["prefill"], self.pools["decode"]
        source = index
        engine, now = instance.engine, instance.clock.now()
        for request_id in engine.ready_to_hand_off():
            tickets = engine.hand_off(request_id, prefill.connectors[source])
            extra = [len(q) + f + len(u) for q, f, u in zip(self._queued, self._in_flight, self._unadmitted)]
            target = decode.router.route(tickets[0].handoff.token_ids, decode.states(extra))
            decode.routed[target] += 1
            transfer = Transfer(tickets, source, target, now, sum(t.num_blocks for t in tickets),
                                sum(t.num_bytes for t in tickets))
            heapq.heappush(self._events, (now, next(self._order), READY, transfer))

    def _on_event(self, moment: float, kind: int, transfer: Transfer) -> None:
        """A hand-off joins its decode instance's queue, or its bytes have arrived."""
        target = transfer.target
        instance = self.pools["decode"].instances[target]
        if kind == READY:
            self._queued[target].append(transfer)
            self._pull(target, moment)
            return
        if not instance.has_work():
            instance.clock.advance_to(moment)
        self._promised[target] -= transfer.num_blocks
        self._in_flight[target] -= 1
        self._unadmitted[target].append(transfer)
        self._admit_waiting(target)
        self._pull(target, instance.clock.now())

    def _pull(self, target: int, now: float) -> None:
        """Start the queued transfers of decode instance ``target`` that its free blocks
        hold, in order (the first always, when nothing else could free blocks)."""
        prefill, decode = self.pools["prefill"], self.pools["decode"]
        instance, queue = decode.instances[target], self._queued[target]
        connector = decode.connectors[target]
        while queue:
            transfer = queue[0]
            room = instance.engine.cache.num_free_blocks - self._promised[target]
            if transfer.num_blocks > room and (self._promised[target] or instance.has_work()
                                               or self._unadmitted[target]):
                return
            queue.popleft()
            self._promised[target] += transfer.num_blocks
            self._in_flight[target] += 1
            transfer.room = max(now, transfer.ready)
            transfer.start = max(transfer.room, prefill.link_free[transfer.source], decode.link_free[target])
            seconds = sum(connector.price(t, self.link.figures, self.link.streams) for t in transfer.tickets)
            transfer.arrived = transfer.start + seconds
            prefill.link_free[transfer.source] = decode.link_free[target] = transfer.arrived
            heapq.heappush(self._events, (transfer.arrived, next(self._order), ARRIVED, transfer))

    def _admit_waiting(self, target: int) -> None:
        """Admit the arrived transfers of decode instance ``target``, in order, while its
        cache has room; a request its engine refuses becomes a failed record."""
        from servelab.core.errors import InvalidRequestError

        instance, waiting = self.pools["decode"].instances[target], self._unadmitted[target]
        connector = self.pools["decode"].connectors[target]
        while waiting:
            transfer = waiting[0]
            try:
                if instance.engine.admit_handed_off(transfer.tickets, connector) is None:
                    return
            except (InvalidRequestError, KVTransferError) as exc:
                handoff = transfer.tickets[0].handoff
                self._finish([RequestRecord(handoff.group, handoff.arrival_time, (), handoff.num_prompt_tokens, 0,
                                            error=str(exc))])
            waiting.popleft()
            transfer.admitted = instance.clock.now()
            self._done.append(transfer)

    # -- statistics -----------------------------------------------------------------------------
    def _summary(self, per_instance: dict[str, list[dict[str, Any]]], span: float) -> dict[str, Any]:
        """Transfer times, queueing and each pool's utilisation, for ``metrics.json``."""
        pools = {role: pool_summary(self.pools[role].instances[0].engine.cfg, per_instance[role],
                                    self.pools[role].routed, span) for role in ROLES}
        return {**transfer_summary(self._done, self._records, self.link), "pools": pools}

    def close(self) -> None:
        """Shut every instance and connector down."""
        for pool in self.pools.values():
            for connector in pool.connectors:
                connector.shutdown()
            for instance in pool.instances:
                instance.close()
