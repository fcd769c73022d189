"""``policy=priority``: lower ``priority`` first, preempting less urgent running requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from servelab.core.component import ComponentSpec
from servelab.core.policy import SchedulingPolicy
from servelab.core.request import Request


@dataclass
class PriorityPolicyConfig:
    """``preempt``: a waiting request that does not fit preempts the least urgent running
    request of a strictly higher ``priority`` value (the latest arrival among equals);
    false: it waits for room."""

    preempt: bool = True


class PriorityPolicy(SchedulingPolicy):
    """Serves the lowest ``priority`` value first (ties: the scheduler's queue order, which
    is arrival); running requests are ranked the same way, so blocks running out preempt
    the least urgent, newest one."""

    def pick(self, waiting: Sequence[Request]) -> Request:
        """The most urgent waiting request, first in queue order among equals."""
        return min(waiting, key=lambda request: request.metadata.priority)

    def order_running(self, running: list[Request]) -> list[Request]:
        """Most urgent first; equals keep the scheduler's order."""
        return sorted(running, key=lambda request: request.metadata.priority)

    def preemption_victim(self, request: Request, candidates: Sequence[Request]) -> Request | None:
        """The least urgent candidate (latest arrival among equals), when it is strictly
        less urgent than ``request`` and ``preempt`` is on."""
        if not self.config.preempt:
            return None
        victim = max(candidates, key=lambda r: (r.metadata.priority, r.arrival_time))
        return victim if victim.metadata.priority > request.metadata.priority else None


SPEC = ComponentSpec("policy", "priority", PriorityPolicy, PriorityPolicyConfig,
                     "lower priority value first, preempting less urgent running requests (as vLLM's)")
