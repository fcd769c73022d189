"""Prefix-cache eviction policies: which block each gives up, ARC's adaptation, and whole
engines whose output does not depend on the policy."""

from __future__ import annotations

import pytest

from servelab import LLM, SamplingParams
from servelab.plugins.cache.arc import ARCEviction
from servelab.plugins.cache.lfu import LFUEviction
from servelab.testing.oracle import hot_prefix_prompts


def cached(policy, *blocks):
    """Cache content ``("k", block)`` in each block and park it."""
    for block in blocks:
        policy.on_cached(block, ("k", block))
        policy.add(block)


def evict(policy):
    """Evict one block, telling the policy its content key as the prefix cache does."""
    block = policy.evict()
    policy.on_evicted(block, ("k", block))
    return block


def test_lfu_evicts_the_least_reused_then_the_least_recently_freed():
    policy = LFUEviction()
    cached(policy, 1, 2, 3, 4)
    for _ in range(2):
        policy.remove(2)  # two prefix hits
        policy.add(2)
    policy.remove(4)
    policy.add(4)
    assert len(policy) == 4
    assert [evict(policy) for _ in range(4)] == [1, 3, 4, 2]
    assert len(policy) == 0


def test_lfu_forgets_the_count_of_evicted_content():
    policy = LFUEviction()
    cached(policy, 1, 2)
    policy.remove(1)
    policy.add(1)
    assert evict(policy) == 2
    policy.on_cached(2, ("k", "new"))
    policy.add(2)
    assert evict(policy) == 2  # new content starts again at 0 hits; block 1 has one


def test_arc_keeps_reused_blocks_on_the_frequent_side_and_evicts_recent_first():
    policy = ARCEviction()
    cached(policy, 1, 2, 3)
    policy.remove(2)
    policy.add(2)
    assert list(policy.recent) == [1, 3] and list(policy.frequent) == [2]
    assert [evict(policy) for _ in range(2)] == [1, 3]
    assert list(policy.recent_ghosts) == [("k", 1), ("k", 3)]


def test_arc_learns_from_ghost_hits():
    policy = ARCEviction()
    cached(policy, 1, 2, 3, 4)
    evict(policy)  # content ("k", 1) becomes a recent ghost
    assert policy.target == 0
    policy.on_cached(1, ("k", 1))  # it comes back: recency was evicted too eagerly
    assert policy.target == 1
    policy.add(1)
    assert 1 in policy.frequent  # content a ghost remembered counts as reused
    policy.remove(3)
    policy.add(3)
    evict(policy)  # recent holds 2 and 4, more than the target 1: evicts 2
    assert ("k", 2) in policy.recent_ghosts
    assert evict(policy) == 1  # recent holds only 4, not above the target: frequent gives up its oldest
    assert ("k", 1) in policy.frequent_ghosts
    policy.on_cached(1, ("k", 1))
    assert policy.target == 0  # a frequent ghost pulls the target back


def shared_prefix_run(eviction: str) -> tuple[list[list[int]], int, int]:
    """``hot_prefix_prompts`` (six rounds) one at a time on a 40-block cache: the tokens
    generated, the prefix tokens found and the blocks evicted."""
    prompts = hot_prefix_prompts(rounds=6)
    overrides = ["cache.block_size=4", "cache.num_blocks=40", "scheduler.max_num_seqs=1", "model.max_model_len=128"]
    if eviction:
        overrides += ["cache.enable_prefix_caching=true", f"cache.eviction={eviction}"]
    llm = LLM("toy", overrides=overrides)
    outputs = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0] for p in prompts]
    cache = llm.engine.cache
    assert cache.usage.used_blocks == 0
    return [o.outputs[0].token_ids for o in outputs], cache.prefix_hit_tokens, cache.prefix_evicted_blocks


@pytest.mark.parametrize("eviction", ["lru", "lfu", "arc"])
def test_every_policy_keeps_the_greedy_output(eviction):
    expected, _, _ = shared_prefix_run("")
    tokens, hits, evicted = shared_prefix_run(eviction)
    assert tokens == expected
    assert hits > 0 and evicted > 0


def test_lfu_and_arc_keep_a_hot_prefix_that_lru_loses():
    _, lru_hits, _ = shared_prefix_run("lru")
    _, lfu_hits, _ = shared_prefix_run("lfu")
    _, arc_hits, _ = shared_prefix_run("arc")
    assert lfu_hits > lru_hits and arc_hits > lru_hits
