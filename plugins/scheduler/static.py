"""``scheduler=static``: request-level batching; a batch runs to completion."""

from __future__ import annotations

from dataclasses import dataclass

from servelab.core.component import ComponentSpec
from servelab.core.scheduler import PreemptionMode, SchedulerOutput
from servelab.plugins.scheduler.base import QueueScheduler


@dataclass
class StaticSchedulerConfig:
    """Up to ``max_batch_size`` requests per batch, whose prompts together fit
    ``max_num_batched_tokens``; ``preemption``: recompute | swap."""

    max_batch_size: int = 8
    max_num_batched_tokens: int = 8192
    preemption: PreemptionMode = PreemptionMode.recompute


class StaticScheduler(QueueScheduler):
    """Admits a batch only when the previous one has fully finished (FasterTransformer
    style); finished requests leave early but nobody joins a running batch."""

    def batch_ready(self) -> bool:
        """Whether a new batch may start now (overridden by ``dynamic``)."""
        return True

    @classmethod
    def config_problems(cls, config, context) -> list[str]:
        """Whole prompts must fit a step; a batch holds at least one request."""
        return (super().config_problems(config, context) + cls.at_least("max_batch_size", config.max_batch_size, 1)
                + cls.holds_a_prompt("max_num_batched_tokens", config.max_num_batched_tokens, context.max_model_len))

    def max_step_tokens(self) -> int:
        """The step budget (``max_num_batched_tokens``)."""
        return self.config.max_num_batched_tokens

    def max_num_seqs(self) -> int:
        """``max_batch_size``."""
        return self.config.max_batch_size

    def schedule(self) -> SchedulerOutput:
        """Prefill a new batch when idle, else advance the running batch."""
        config = self.config
        self._swap_in_ready()
        if not self.running and not self.swapped:
            if not self.waiting or not self.batch_ready():
                return self._output([])
            admitted, _ = self._admit(config.max_num_batched_tokens, config.max_batch_size)
            return self._output(admitted)
        grants, _, preempted = self._schedule_running(config.max_num_batched_tokens)
        return self._output(grants, preempted)


SPEC = ComponentSpec("scheduler", "static", StaticScheduler, StaticSchedulerConfig,
                     "request-level batching: a batch runs to completion before the next")
