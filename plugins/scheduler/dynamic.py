"""``scheduler=dynamic``: request-level batching launched by size or by waiting time."""

from __future__ import annotations

from dataclasses import dataclass

from servelab.core.component import ComponentSpec
from servelab.core.scheduler import PreemptionMode
from servelab.plugins.scheduler.static import StaticScheduler


@dataclass
class DynamicSchedulerConfig:
    """A batch starts when ``max_batch_size`` requests wait or the oldest has waited
    ``max_wait_ms``, whichever comes first; it then runs to completion."""

    max_batch_size: int = 8
    max_wait_ms: float = 50.0
    max_num_batched_tokens: int = 8192
    preemption: PreemptionMode = PreemptionMode.recompute


class DynamicScheduler(StaticScheduler):
    """Static batching whose launch waits for a full batch or a timeout (Triton-style)."""

    @classmethod
    def config_problems(cls, config, context) -> list[str]:
        """A timeout cannot be negative."""
        return super().config_problems(config, context) + cls.at_least("max_wait_ms", config.max_wait_ms, 0)

    def batch_ready(self) -> bool:
        """A full batch is waiting, or the oldest request has waited long enough."""
        if len(self.waiting) >= self.config.max_batch_size:
            return True
        waited_ms = (self.context.clock.now() - self.waiting[0].arrival_time) * 1000.0
        return waited_ms >= self.config.max_wait_ms

    def next_wakeup(self) -> float | None:
        """When the oldest waiting request's timeout expires (on the context's clock)."""
        if self.running or not self.waiting:
            return None
        return self.waiting[0].arrival_time + self.config.max_wait_ms / 1000.0


SPEC = ComponentSpec("scheduler", "dynamic", DynamicScheduler, DynamicSchedulerConfig,
                     "request-level batching launched at max_batch_size or after max_wait_ms")
