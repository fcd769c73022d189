"""``router=round_robin``: replicas in turn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from servelab.core.component import ComponentSpec
from servelab.core.router import ReplicaState, Router, RouterContext


@dataclass
class RoundRobinRouterConfig:
    """``router=round_robin``: no options."""


class RoundRobinRouter(Router):
    """The next replica each time, whatever its load."""

    def __init__(self, config: RoundRobinRouterConfig, context: RouterContext):
        super().__init__(config, context)
        self._next = 0

    def route(self, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """Replica 0, 1, ..., N-1, 0, ..."""
        index = self._next % len(replicas)
        self._next += 1
        return index


SPEC = ComponentSpec("router", "round_robin", RoundRobinRouter, RoundRobinRouterConfig,
                     "replicas in turn (default)")
