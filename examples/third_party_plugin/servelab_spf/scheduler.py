"""Shortest-prompt-first admission over servelab's queue scheduler."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from servelab.core.scheduler import SchedulerOutput
from servelab.plugins.scheduler.base import QueueScheduler


@dataclass
class ShortestPromptFirstConfig:
    """``max_num_seqs`` running requests and ``max_num_batched_tokens`` per step at most."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192


class ShortestPromptFirstScheduler(QueueScheduler):
    """Running requests decode every step; free room goes to the waiting request with the
    fewest tokens left to compute (ties keep arrival order)."""

    def schedule(self) -> SchedulerOutput:
        """Decode the running requests, then admit shortest prompts first."""
        grants, used, preempted = self._schedule_running(self.config.max_num_batched_tokens)
        if not preempted:
            self.waiting = deque(sorted(self.waiting, key=lambda r: r.num_tokens - r.num_computed_tokens))
            admitted, _ = self._admit(self.config.max_num_batched_tokens - used, self.config.max_num_seqs)
            grants += admitted
        return self._output(grants, preempted)
