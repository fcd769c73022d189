"""``scheduler=chunked``: Sarathi-Serve stall-free batching with chunked prefills."""

from __future__ import annotations

from dataclasses import dataclass

from servelab.core.component import ComponentSpec
from servelab.core.scheduler import PreemptionMode, SchedulerOutput
from servelab.plugins.scheduler.base import QueueScheduler


@dataclass
class ChunkedSchedulerConfig:
    """Each step holds at most ``token_budget`` tokens (decodes, lookahead slots and
    prefill chunks together) and ``max_num_seqs`` running requests."""

    token_budget: int = 512
    max_num_seqs: int = 256
    preemption: PreemptionMode = PreemptionMode.recompute


class ChunkedScheduler(QueueScheduler):
    """Running decodes first, then ongoing partial prefills, then new requests; a prompt
    is split into chunks that fit the remaining budget, so a long prefill never stalls
    the decodes, and decode and prefill tokens share one forward pass."""

    @classmethod
    def config_problems(cls, config, context) -> list[str]:
        """A step must hold a decode token and its lookahead slots."""
        return (super().config_problems(config, context) + cls.at_least("max_num_seqs", config.max_num_seqs, 1)
                + cls.at_least("token_budget", config.token_budget, 1 + context.num_lookahead_tokens))

    def max_step_tokens(self) -> int:
        """The step budget (``token_budget``)."""
        return self.config.token_budget

    def max_num_seqs(self) -> int:
        """``max_num_seqs``."""
        return self.config.max_num_seqs

    def schedule(self) -> SchedulerOutput:
        """Fill the step's token budget in stall-free order."""
        budget = self.config.token_budget
        self._swap_in_ready()
        self.running.sort(key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        grants, used, preempted = self._schedule_running(budget)
        if not preempted and not self.swapped:
            admitted, _ = self._admit(budget - used, self.config.max_num_seqs, chunk=True)
            grants += admitted
        return self._output(grants, preempted)


SPEC = ComponentSpec("scheduler", "chunked", ChunkedScheduler, ChunkedSchedulerConfig,
                     "Sarathi-Serve stall-free batching: decodes first, prompts in token_budget chunks")
