"""``policy=deadline``: earliest deadline first, refusing or deferring requests that
can no longer meet theirs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.policy import SchedulingPolicy
from servelab.core.request import Request

ON_HOPELESS = ("reject", "deprioritize")


@dataclass
class DeadlinePolicyConfig:
    """``on_hopeless``: what happens to a waiting request that can no longer meet its
    first-token deadline: ``reject`` finishes it at once with finish reason ``deadline``
    (the HTTP server answers 503), ``deprioritize`` serves it only when no request that
    can still make it waits. ``slack``: seconds its first token needs at least (a prefill's
    time): a request is hopeless once ``now + slack`` is past that deadline."""

    on_hopeless: str = "reject"
    slack: float = 0.0


class EarliestDeadlineFirst(SchedulingPolicy):
    """Serves the request whose next token is due first.

    A request's next token is due by the earlier of its ``deadline`` (the whole response)
    and its SLO class's schedule: the first token ``ttft`` seconds after arrival, the
    k-th ``(k - 1) * tpot`` seconds after that. Requests with neither come after every
    request that has one, in arrival order. Running requests are ranked the same way, so
    blocks running out preempt the one due last. A waiting request that has produced no
    token and cannot be served by its first deadline is hopeless (``on_hopeless``); once
    declared hopeless it never goes ahead of a request that is not."""

    def __init__(self, config: DeadlinePolicyConfig, context):
        problems = ([f"policy.on_hopeless must be one of {', '.join(ON_HOPELESS)}, got {config.on_hopeless!r}"]
                    if config.on_hopeless not in ON_HOPELESS else [])
        problems += [f"policy.slack must be >= 0 seconds, got {config.slack}"] if config.slack < 0 else []
        if problems:
            raise ConfigError(problems)
        super().__init__(config, context)
        self.hopeless_ids: set[str] = set()

    def due(self, request: Request) -> float:
        """When the request's next token is due on the engine clock (inf: no deadline)."""
        due = math.inf if request.deadline_time is None else request.deadline_time
        name = request.metadata.slo_class
        if name is not None:
            slo = self.context.slo_classes[name]
            due = min(due, request.arrival_time + slo.ttft + request.num_output_tokens * slo.tpot)
        return due

    def _rank(self, request: Request) -> tuple[bool, float]:
        return request.request_id in self.hopeless_ids, self.due(request)

    def pick(self, waiting: Sequence[Request]) -> Request:
        """The waiting request due first, those declared hopeless last."""
        return min(waiting, key=self._rank)

    def order_running(self, running: list[Request]) -> list[Request]:
        """Due first, first; equals keep the scheduler's order."""
        return sorted(running, key=self.due)

    def hopeless(self, waiting: Sequence[Request]) -> list[Request]:
        """Waiting requests with no token yet whose first deadline ``now + slack`` has
        passed: returned to be refused (``reject``), or remembered to go last."""
        late_after = self.context.clock.now() + self.config.slack
        late = [request for request in waiting if request.num_output_tokens == 0
                and request.request_id not in self.hopeless_ids and self.due(request) < late_after]
        if self.config.on_hopeless == "reject":
            return late
        self.hopeless_ids.update(request.request_id for request in late)
        return []

    def on_finished(self, request: Request) -> None:
        """Forget a finished request."""
        self.hopeless_ids.discard(request.request_id)


SPEC = ComponentSpec("policy", "deadline", EarliestDeadlineFirst, DeadlinePolicyConfig,
                     "earliest deadline first; refuses (or defers) requests that can no longer meet theirs")
