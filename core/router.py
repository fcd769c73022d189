"""The router contract: which engine replica serves an arriving request.

Routers are registered components (``router=round_robin``, ``least_loaded``,
``prefix_affinity``, ...) built as ``cls(config, RouterContext)``. ``servelab-bench
target.replicas=N`` routes a simulated cluster's traffic through one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from servelab.core.kv_cache import KVCacheEvent


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What a router sees of one replica when a request arrives: its ``index``, the
    requests it runs and queues, and the share of its KV cache in use."""

    index: int
    num_running: int
    num_waiting: int
    kv_usage: float

    @property
    def load(self) -> int:
        """Requests it holds, running or queued."""
        return self.num_running + self.num_waiting


@dataclass(frozen=True, slots=True)
class RouterContext:
    """What a router is built for: ``num_replicas`` replicas whose caches have blocks of
    ``block_size`` tokens (the unit a prefix cache shares)."""

    num_replicas: int
    block_size: int


class Router(abc.ABC):
    """Picks a replica for each request. Built as ``cls(config, RouterContext)``; a
    constructor raises ``ConfigError`` listing every problem of its config. A router with
    ``uses_cache_events`` hears what each replica's prefix cache stored and evicted
    (``on_cache_events``), as the replicas step."""

    uses_cache_events: bool = False
    """True when the router wants each replica's ``KVCacheEvent``s."""

    def __init__(self, config: Any, context: RouterContext):
        self.config = config
        self.context = context

    def on_cache_events(self, replica: int, events: Sequence[KVCacheEvent]) -> None:
        """What replica ``replica``'s cache stored and evicted since its last events, in
        order (only called when ``uses_cache_events``); nothing by default."""

    @abc.abstractmethod
    def route(self, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """The index of the replica that serves a request with this prompt."""
