"""Conformance kit for scheduling policies: the contract's answers, unchanged greedy
output under every scheduler and both preemption modes, and a stress with aborts."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import pytest

from servelab.core.request_metadata import RequestMetadata
from servelab.core.sampling_params import SamplingParams
from servelab.testing.engine_kit import EngineKit, record_steps
from servelab.testing.stress import STRESS_CACHE, run_stress

LENGTHS = (3, 17, 40, 9, 64, 25, 33, 12)
SLO_CLASSES = ("+slo_classes.loose={ttft:1000,tpot:1000}", "+slo_classes.steady={ttft:500,tpot:100}")
"""Service levels every kit engine defines: loose enough that nothing is refused."""
TIGHT_CLASS = "+slo_classes.tight={ttft:0.002,tpot:0.001}"
"""A class the stress adds, which a deadline policy finds hopeless within milliseconds."""


def mixed_metadata(count: int) -> list[RequestMetadata]:
    """Metadata that makes every policy reorder: priorities, three tenants, both loose
    SLO classes and far deadlines, varied per request."""
    return [RequestMetadata(priority=(i * 7) % 5 - 2, tenant=("alice", "bob", None)[i % 3],
                            slo_class=(None, "loose", "steady")[(i // 2) % 3],
                            deadline=time.time() + 3600.0 + 60 * (count - i) if i % 4 == 0 else None)
            for i in range(count)]


class PolicyConformance(EngineKit):
    """The ``SchedulingPolicy`` contract: ``pick`` returns a waiting request,
    ``order_running`` a permutation, ``preemption_victim`` a candidate or None,
    ``hopeless`` waiting requests; greedy output equal to transformers under every
    registered scheduler (a policy changes the order, never the tokens); the same with
    preemption by recompute and by swap on a small cache; ``run_stress`` (random
    metadata, a tight SLO class, aborts) under both modes ends every request and holds
    no block afterwards."""

    kind = "policy"
    preempting_cache: ClassVar[tuple[str, ...]] = ("cache=paged", "cache.block_size=4", "cache.num_blocks=40")
    schedulers: ClassVar[tuple[str, ...] | None] = None
    """The schedulers to compose with (None: every registered one)."""

    def pytest_generate_tests(self, metafunc: Any) -> None:
        """Parametrize ``component`` over the policies and ``scheduler`` over the schedulers."""
        super().pytest_generate_tests(metafunc)
        if "scheduler" in metafunc.fixturenames:
            from servelab.core.engine.registry import get_registry

            metafunc.parametrize("scheduler", self.schedulers or sorted(get_registry().specs("scheduler")))

    def overrides_for(self, name: str, checkpoint: str, draft: str, *extra: str) -> list[str]:
        """The kit's engine with policy ``name`` and the kit's SLO classes."""
        return super().overrides_for(name, checkpoint, draft, *SLO_CLASSES, *extra)

    def test_contract_answers(self, component, kit_checkpoint, kit_draft):
        from servelab.core.request import Request

        llm = self.llm(component, kit_checkpoint, kit_draft)
        policy = llm.engine.policy
        now = llm.engine.clock.now()
        requests = [Request(f"r{i}", [1] * (i + 1), SamplingParams(), None, arrival_time=now, metadata=metadata)
                    for i, metadata in enumerate(mixed_metadata(6))]
        for request in requests:
            policy.check_request(request)
        waiting: list[Request] = []
        for request in requests:
            waiting.append(request)
            policy.on_queued(request, waiting)
        for _ in range(len(requests)):
            chosen = policy.pick(waiting)
            assert any(chosen is r for r in waiting), f"pick returned {chosen!r}, not a waiting request"
            waiting.remove(chosen)
            policy.on_admitted(chosen)
            policy.on_tokens(chosen, 1)
        ranked = policy.order_running(list(requests))
        assert sorted(map(id, ranked)) == sorted(map(id, requests)), "order_running is not a permutation"
        victim = policy.preemption_victim(requests[0], requests[1:])
        assert victim is None or any(victim is r for r in requests[1:]), f"victim {victim!r} is no candidate"
        hopeless = policy.hopeless(requests)
        assert all(any(h is r for r in requests) for h in hopeless), "hopeless named a request not waiting"
        for request in requests:
            policy.on_finished(request)

    def test_greedy_output_unchanged_under_every_scheduler(self, component, scheduler, kit_checkpoint, kit_draft):
        from servelab.testing.oracle import assert_engine_matches_transformers

        llm = self.llm(component, kit_checkpoint, kit_draft, f"scheduler={scheduler}")
        prompts = self.prompts(llm.engine.vocab_size, LENGTHS)
        assert_engine_matches_transformers(kit_checkpoint, prompts=prompts, max_tokens=12, llm=llm,
                                           metadata=mixed_metadata(len(prompts)))

    @pytest.mark.parametrize("mode", ["recompute", "swap"])
    def test_preemption_keeps_greedy_output(self, component, kit_checkpoint, kit_draft, mode):
        from servelab.testing.oracle import assert_engine_matches_transformers

        extra = [*self.preempting_cache, f"scheduler.preemption={mode}"]
        if mode == "swap":
            extra.append("cache.swap_space_bytes=1000000")
        llm = self.llm(component, kit_checkpoint, kit_draft, *extra)
        prompts = self.prompts(llm.engine.vocab_size, LENGTHS)
        steps = record_steps(llm.engine)
        assert_engine_matches_transformers(kit_checkpoint, prompts=prompts, max_tokens=24, llm=llm,
                                           metadata=mixed_metadata(len(prompts)))
        assert any(output.preempted for output in steps.outputs), "the small cache never preempted"

    @pytest.mark.parametrize("mode", ["recompute", "swap"])
    def test_stress_with_aborts_holds_no_block(self, component, kit_checkpoint, kit_draft, mode):
        overrides = ["model=local", f"model.path={kit_checkpoint}",
                     *self.overrides_for(component, kit_checkpoint, kit_draft, TIGHT_CLASS, *STRESS_CACHE,
                                         f"scheduler.preemption={mode}")]
        report = run_stress(overrides, num_requests=40, seed=3)
        assert report.num_finished + report.num_aborted == report.num_requests
