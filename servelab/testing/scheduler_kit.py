"""Conformance kit for schedulers: limits, block coverage, completion, preemption and
aborts, on whole engines."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from servelab.core.sampling_params import SamplingParams
from servelab.testing.engine_kit import EngineKit, record_steps, run_to_completion

LENGTHS = (3, 17, 40, 9, 64, 25, 33, 12)


def assert_step_within_limits(scheduler: Any, output: Any, block_size: int) -> None:
    """The step holds no more tokens and requests than the policy allows, and every
    grant has the blocks for its tokens."""
    budget = scheduler.max_step_tokens()
    reserved = output.num_tokens + output.num_lookahead_tokens * output.num_decode_tokens
    if budget is not None:
        assert reserved <= budget, f"step {output.step_index}: {reserved} tokens and lookahead slots > {budget}"
    limit = scheduler.max_num_seqs()
    if limit is not None:
        assert len(output.scheduled) <= limit, f"step {output.step_index}: {len(output.scheduled)} > {limit}"
        assert scheduler.num_running <= limit, f"{scheduler.num_running} running > max_num_seqs {limit}"
    for grant in output.scheduled:
        needed = grant.num_computed_tokens + grant.num_new_tokens
        assert len(grant.block_ids) * block_size >= needed, \
            f"{grant.request.request_id} scheduled {needed} tokens with {len(grant.block_ids)} blocks"


class SchedulerConformance(EngineKit):
    """The ``Scheduler`` contract on whole engines: greedy output equal to transformers;
    every step within ``max_step_tokens`` and ``max_num_seqs`` with the blocks for its
    tokens; every request finishes; preemption by recompute and by swap (skipped when the
    config has no ``preemption`` field) gives the same greedy output; aborts free every
    block. ``preempting_cache`` sizes a paged cache small enough to preempt."""

    kind = "scheduler"
    preempting_cache: ClassVar[tuple[str, ...]] = ("cache=paged", "cache.block_size=4", "cache.num_blocks=40")

    def test_greedy_matches_transformers(self, component, kit_checkpoint, kit_draft):
        from servelab.testing.oracle import assert_engine_matches_transformers

        assert_engine_matches_transformers(kit_checkpoint, self.overrides_for(component, kit_checkpoint, kit_draft))

    def test_steps_respect_limits_and_every_request_finishes(self, component, kit_checkpoint, kit_draft):
        llm = self.llm(component, kit_checkpoint, kit_draft, "cache.block_size=8")
        engine = llm.engine
        steps = record_steps(engine)
        prompts = self.prompts(engine.vocab_size, LENGTHS * 3)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1 + i % 9, ignore_eos=True))
        finished = run_to_completion(engine)
        assert sorted(o.request_id for o in finished) == sorted(str(i) for i in range(len(prompts)))
        assert all(o.outputs[0].finish_reason == "length" for o in finished)
        for output in steps.outputs:
            assert_step_within_limits(engine.scheduler, output, engine.cache.block_size)
        assert engine.cache.usage.used_blocks == 0

    @pytest.mark.parametrize("mode", ["recompute", "swap"])
    def test_preemption_keeps_greedy_output(self, component, kit_checkpoint, kit_draft, mode):
        from servelab.testing.oracle import assert_engine_matches_transformers

        extra = [*self.preempting_cache, f"scheduler.preemption={mode}"]
        if mode == "swap":
            extra.append("cache.swap_space_bytes=1000000")
        llm = self.llm_or_skip(component, kit_checkpoint, kit_draft, *extra)
        prompts = self.prompts(llm.engine.vocab_size, LENGTHS)
        steps = record_steps(llm.engine)
        assert_engine_matches_transformers(kit_checkpoint, prompts=prompts, max_tokens=24, llm=llm)
        assert any(output.preempted for output in steps.outputs), "the small cache never preempted"

    def test_abort_frees_every_block(self, component, kit_checkpoint, kit_draft):
        llm = self.llm(component, kit_checkpoint, kit_draft)
        engine = llm.engine
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=20, n=1 + i % 2))
               for i, p in enumerate(self.prompts(engine.vocab_size, LENGTHS))]
        for _ in range(3):
            engine.step()
        engine.abort_request(ids[::2])
        engine.step()
        engine.abort_request(ids[1::2])
        assert not engine.has_unfinished_requests()
        assert engine.cache.usage.used_blocks == 0
        (output,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 3

    def llm_or_skip(self, name: str, checkpoint: str, draft: str, *extra: str) -> Any:
        """``llm``, skipping when the component's config has no field an override sets."""
        from hydra.errors import ConfigCompositionException

        try:
            return self.llm(name, checkpoint, draft, *extra)
        except ConfigCompositionException as exc:
            pytest.skip(f"scheduler={name} cannot take {list(extra)}: {exc}")
