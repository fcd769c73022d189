"""``policy=vtc``: fair sharing by a virtual token counter per tenant (Sheng et al., OSDI'24)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.policy import SchedulingPolicy
from servelab.core.request import Request

COUNTERS = ("tokens", "requests")


@dataclass
class VirtualTokenCounterConfig:
    """``input_weight`` / ``output_weight``: what a prompt token / a generated token adds to
    its tenant's counter (the paper's w_p = 1, w_q = 2); ``tenant_weights``: a tenant's
    share relative to the others (default 1: its counter grows by the service divided by
    its weight); ``counter``: ``tokens`` (the paper's service measure) or ``requests``
    (each admitted request counts 1, whatever its length: request-count fairness, the
    baseline the paper compares against)."""

    input_weight: float = 1.0
    output_weight: float = 2.0
    tenant_weights: dict[str, float] = field(default_factory=dict)
    counter: str = "tokens"


class VirtualTokenCounter(SchedulingPolicy):
    """Admits the earliest request of the backlogged tenant whose counter is lowest.

    A tenant's counter grows by the weighted prompt tokens of each request it gets
    admitted (charged once, at its first admission; ``n`` sequences share one prompt) and
    the weighted tokens it generates.
    A tenant that joins the queue with nothing waiting is lifted to the lowest counter of
    the tenants waiting (to the last admitted tenant's when none waits), so it cannot
    bank service it did not ask for. Between two tenants that stay backlogged the service
    received differs by a bounded amount (the paper's Theorem 4.1)."""

    def __init__(self, config: VirtualTokenCounterConfig, context):
        problems = ([f"policy.counter must be one of {', '.join(COUNTERS)}, got {config.counter!r}"]
                    if config.counter not in COUNTERS else [])
        problems += [f"policy.{name} must be >= 0, got {value}"
                     for name, value in (("input_weight", config.input_weight), ("output_weight", config.output_weight))
                     if value < 0]
        problems += [f"policy.tenant_weights.{tenant} must be > 0, got {weight}"
                     for tenant, weight in config.tenant_weights.items() if not weight > 0]
        if problems:
            raise ConfigError(problems)
        super().__init__(config, context)
        self.counters: defaultdict[str, float] = defaultdict(float)
        self._charged: set[str] = set()
        self._last_admitted: str | None = None

    def _charge(self, tenant: str, service: float) -> None:
        self.counters[tenant] += service / self.config.tenant_weights.get(tenant, 1.0)

    def on_queued(self, request: Request, waiting: Sequence[Request]) -> None:
        """Lift a tenant that had nothing waiting to the lowest waiting counter."""
        tenant = request.metadata.tenant_name
        others = {r.metadata.tenant_name for r in waiting if r is not request}
        if tenant in others:
            return
        if others:
            floor = min(self.counters[other] for other in others)
        elif self._last_admitted is not None:
            floor = self.counters[self._last_admitted]
        else:
            return
        self.counters[tenant] = max(self.counters[tenant], floor)

    def pick(self, waiting: Sequence[Request]) -> Request:
        """The first waiting request of the tenant with the lowest counter."""
        counters = self.counters
        return min(waiting, key=lambda request: counters[request.metadata.tenant_name])

    def on_admitted(self, request: Request) -> None:
        """Charge the prompt (once per request, not again after a preemption)."""
        tenant = request.metadata.tenant_name
        self._last_admitted = tenant
        if request.request_id in self._charged:
            return
        self._charged.add(request.request_id)
        self._charge(tenant, 1.0 if self.config.counter == "requests"
                     else self.config.input_weight * request.num_prompt_tokens)

    def on_tokens(self, request: Request, num_tokens: int) -> None:
        """Charge generated tokens (counting by tokens)."""
        if self.config.counter == "tokens":
            self._charge(request.metadata.tenant_name, self.config.output_weight * num_tokens)

    def on_finished(self, request: Request) -> None:
        """Forget the request's charge mark."""
        self._charged.discard(request.request_id)


SPEC = ComponentSpec("policy", "vtc", VirtualTokenCounter, VirtualTokenCounterConfig,
                     "fair share per tenant by a virtual token counter (VTC, OSDI'24); counter=requests: by request count")
