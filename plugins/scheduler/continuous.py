"""``scheduler=continuous``: iteration-level batching (Orca, vLLM)."""

from __future__ import annotations

from dataclasses import dataclass

from servelab.core.component import ComponentSpec
from servelab.core.scheduler import PreemptionMode, SchedulerOutput
from servelab.plugins.scheduler.base import QueueScheduler


@dataclass
class ContinuousSchedulerConfig:
    """``max_num_seqs`` running requests at most; ``max_num_batched_tokens`` tokens per step
    (must hold a whole prompt, so at least ``max_model_len``). ``mix_prefill_decode``:
    false = a step with new prompts runs only prefills (decodes wait, vLLM's policy);
    true = new prompts join the running decodes in one step (Orca's hybrid iterations).
    ``preemption``: recompute | swap."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    mix_prefill_decode: bool = False
    preemption: PreemptionMode = PreemptionMode.recompute


class ContinuousScheduler(QueueScheduler):
    """Admits waiting requests whenever sequence, token and KV limits allow; prefill first.
    When blocks run out the newest running request is preempted (recompute)."""

    def schedule(self) -> SchedulerOutput:
        """One step of prefills (new prompts) or decodes, or both when mixing."""
        config = self.config
        budget = config.max_num_batched_tokens
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
