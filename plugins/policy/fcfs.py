"""``policy=fcfs``: first come, first served (every scheduler's order without a policy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from servelab.core.component import ComponentSpec
from servelab.core.policy import SchedulingPolicy
from servelab.core.request import Request


@dataclass
class FirstComeFirstServedConfig:
    """First come, first served has no settings."""


class FirstComeFirstServed(SchedulingPolicy):
    """Admits in the scheduler's queue order (arrival; preempted requests first) and
    preempts the newest running request when blocks run out: a passive policy, which a
    scheduler need not ask."""

    passive = True

    def pick(self, waiting: Sequence[Request]) -> Request:
        """The head of the queue."""
        return waiting[0]


SPEC = ComponentSpec("policy", "fcfs", FirstComeFirstServed, FirstComeFirstServedConfig,
                     "first come, first served: the scheduler's arrival order (the default)")
