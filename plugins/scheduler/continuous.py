"""``scheduler=continuous``: iteration-level batching (Orca, vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servelab.core.component import ComponentSpec
from servelab.core.scheduler import PreemptionMode, SchedulerOutput
from servelab.plugins.scheduler.base import QueueScheduler


# Tokens per step when max_num_batched_tokens is unset (raised to max_model_len if that is longer).
DEFAULT_BATCHED_TOKENS = 2048


@dataclass
class ContinuousSchedulerConfig:
    """``max_num_seqs`` running requests at most; ``max_num_batched_tokens`` tokens per step
    (must hold a whole prompt, so at least ``max_model_len``; unset: max(2048,
    ``max_model_len``), which keeps prefill steps small enough for the CPU caches). ``mix_prefill_decode``:
    false = a step with new prompts runs only prefills (decodes wait, vLLM's policy);
    true = new prompts join the running decodes in one step (Orca's hybrid iterations).
    ``preemption``: recompute | swap."""

    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    mix_prefill_decode: bool = False
    preemption: PreemptionMode = PreemptionMode.recompute


class ContinuousScheduler(QueueScheduler):
    """Admits waiting requests whenever sequence, token and KV limits allow; prefill first.
    When blocks run out the newest running request is preempted (recompute)."""

    def __init__(self, config, context):
        super().__init__(config, context)
        self.token_budget = config.max_num_batched_tokens or max(DEFAULT_BATCHED_TOKENS, context.max_model_len)

    @classmethod
    def config_problems(cls, config, context) -> list[str]:
        """Whole prompts must fit a step; at least one running request."""
        return (super().config_problems(config, context) + cls.at_least("max_num_seqs", config.max_num_seqs, 1)
                + cls.holds_a_prompt("max_num_batched_tokens", config.max_num_batched_tokens, context.max_model_len))

    def max_step_tokens(self) -> int:
        """The step budget (``max_num_batched_tokens`` or its default)."""
        return self.token_budget

    def max_num_seqs(self) -> int:
        """``max_num_seqs``."""
        return self.config.max_num_seqs

    def schedule(self) -> SchedulerOutput:
        """One step of prefills (new prompts) or decodes, or both when mixing."""
        config = self.config
        budget = self.token_budget
        self._swap_in_ready()
        if not config.mix_prefill_decode:
            admitted = [] if self.swapped else self._admit(budget, config.max_num_seqs)[0]
            if admitted:
                return self._output(admitted)
            grants, _, preempted = self._schedule_running(budget)
            return self._output(grants, preempted)
        grants, used, preempted = self._schedule_running(budget)
        if not preempted and not self.swapped:
            admitted, _ = self._admit(budget - used, config.max_num_seqs)
            grants += admitted
        return self._output(grants, preempted)


SPEC = ComponentSpec("scheduler", "continuous", ContinuousScheduler, ContinuousSchedulerConfig,
                     "iteration-level batching: admit whenever room allows, prefill first (Orca/vLLM)")
