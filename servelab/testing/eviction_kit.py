"""Conformance kit for prefix-cache eviction policies: the ``EvictionPolicy`` contract on
random sequences of parks, hits and evictions, and whole engines whose greedy output does
not depend on the policy."""

from __future__ import annotations

from typing import Any

from servelab.testing.kit import ConformanceKit


def play_eviction_operations(policy: Any, ops: list[tuple[str, int]]) -> None:
    """Apply ``(operation, block)`` steps to blocks 0-11 the way the paged cache does:
    ``cache`` (new content, announced with ``on_cached``), ``park`` (``add`` of a cached
    block nobody holds), ``hit`` (``remove`` of a parked block) and ``evict`` (when any is
    parked; ``on_evicted`` follows). After each step ``len`` counts the parked blocks, and
    ``evict`` returns a parked block, each exactly once."""
    cached: set[int] = set()
    parked: set[int] = set()
    generation = 0
    for op, block in ops:
        if op == "cache" and block not in cached:
            generation += 1
            policy.on_cached(block, ("kit", block, generation))
            cached.add(block)
        elif op == "park" and block in cached and block not in parked:
            policy.add(block)
            parked.add(block)
        elif op == "hit" and block in parked:
            policy.remove(block)
            parked.discard(block)
        elif op == "evict" and parked:
            victim = policy.evict()
            assert victim in parked, f"evict() returned {victim}, which is not parked ({sorted(parked)})"
            parked.discard(victim)
            cached.discard(victim)
            policy.on_evicted(victim, ("kit", victim, generation))
        assert len(policy) == len(parked), f"len() is {len(policy)} with {len(parked)} blocks parked"
    evicted = [policy.evict() for _ in range(len(parked))]
    assert sorted(evicted) == sorted(parked) and len(policy) == 0


class EvictionConformance(ConformanceKit):
    """The ``EvictionPolicy`` contract: random sequences of caching, parking, hits and
    evictions (hypothesis) where ``len`` always counts the parked blocks and ``evict``
    returns each parked block once; and an engine whose prefix cache must evict, with
    greedy output equal to one without prefix caching and no block held afterwards."""

    kind = "eviction"

    def test_random_operations_keep_the_contract(self, component):
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st

        from servelab.core.engine.registry import get_registry

        policy_cls = get_registry().get("eviction", component).cls
        operations = st.lists(st.tuples(st.sampled_from(["cache", "park", "hit", "evict"]), st.integers(0, 11)),
                              max_size=80)

        @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
        @given(operations)
        def run(ops):
            play_eviction_operations(policy_cls(), ops)

        run()

    def test_greedy_output_is_the_same_under_eviction(self, component):
        from servelab import LLM, SamplingParams
        from servelab.testing.oracle import assert_no_leaked_blocks, hot_prefix_prompts

        params = SamplingParams(temperature=0.0, max_tokens=4)
        overrides = ["model.max_model_len=128", "cache.block_size=4", "cache.num_blocks=40", "scheduler.max_num_seqs=1"]
        prompts = hot_prefix_prompts(rounds=3)
        plain = LLM("toy", overrides=overrides)
        expected = [plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        llm = LLM("toy", overrides=[*overrides, "cache.enable_prefix_caching=true", f"cache.eviction={component}"])
        got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert got == expected
        assert llm.engine.cache.prefix_evicted_blocks > 0 and llm.engine.cache.prefix_hit_tokens > 0
        assert_no_leaked_blocks(llm)
