"""Shortest-prompt-first admission over servelab's queue scheduler."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from servelab.core.scheduler import PreemptionMode, SchedulerOutput
from servelab.plugins.scheduler.base import QueueScheduler


@dataclass
class ShortestPromptFirstConfig:
    """``max_num_seqs`` running requests and ``max_num_batched_tokens`` per step at most;
    ``preemption``: recompute | swap when blocks run out."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    preemption: PreemptionMode = PreemptionMode.recompute


class ShortestPromptFirstScheduler(QueueScheduler):
    """Running requests decode every step; free room goes to the waiting request with the
    fewest tokens left to compute (ties keep arrival order)."""

    @classmethod
    def config_problems(cls, config, context) -> list[str]:
        """Whole prompts must fit a step; at least one running request."""
        return (super().config_problems(config, context) + cls.at_least("max_num_seqs", config.max_num_seqs, 1)
                + cls.holds_a_prompt("max_num_batched_tokens", config.max_num_batched_tokens, context.max_model_len))

    def max_step_tokens(self) -> int:
        """``max_num_batched_tokens``."""
        return self.config.max_num_batched_tokens

    def max_num_seqs(self) -> int:
        """``max_num_seqs``."""
        return self.config.max_num_seqs

    def schedule(self) -> SchedulerOutput:
        """Bring swapped requests back, decode the running ones, then admit shortest prompts first."""
        self._swap_in_ready()
        grants, used, preempted = self._schedule_running(self.config.max_num_batched_tokens)
        if not preempted and not self.swapped:
            self.waiting = deque(sorted(self.waiting, key=lambda r: r.num_tokens - r.num_computed_tokens))
            admitted, _ = self._admit(self.config.max_num_batched_tokens - used, self.config.max_num_seqs)
            grants += admitted
        return self._output(grants, preempted)
