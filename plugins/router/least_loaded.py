"""``router=least_loaded``: the replica holding the fewest requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from servelab.core.component import ComponentSpec
from servelab.core.router import ReplicaState, Router


@dataclass
class LeastLoadedRouterConfig:
    """``router=least_loaded``: no options."""


def least_loaded(replicas: Sequence[ReplicaState]) -> int:
    """The replica with the fewest running and queued requests, then the emptiest KV
    cache, then the lowest index."""
    return min(replicas, key=lambda r: (r.load, r.kv_usage, r.index)).index


class LeastLoadedRouter(Router):
    """Sends each request where the fewest requests run or wait (join the shortest queue)."""

    def route(self, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """``least_loaded(replicas)``."""
        return least_loaded(replicas)


SPEC = ComponentSpec("router", "least_loaded", LeastLoadedRouter, LeastLoadedRouterConfig,
                     "the replica with the fewest running and queued requests")
