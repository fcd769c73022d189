"""Prefix-cache events and the KV-aware router that reads them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servelab import LLM, ConfigError, SamplingParams
from servelab.core.kv_cache import KVCacheEvent, block_hashes
from servelab.core.router import ReplicaState, RouterContext
from servelab.plugins.router.kv_aware import KVAwareRouter, KVAwareRouterConfig

BLOCK = 4


def test_block_hashes_agree_across_processes():
    tokens = list(range(3, 19))
    here = block_hashes(tokens, BLOCK, 4)
    code = f"from servelab.core.kv_cache import block_hashes; print(block_hashes({tokens}, {BLOCK}, 4))"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert str(here) == there.strip()


def test_cache_records_stored_and_evicted_blocks_once_started():
    llm = LLM("toy", overrides=["cache.enable_prefix_caching=true", f"cache.block_size={BLOCK}", "cache.num_blocks=12",
                                "model.max_model_len=40", "scheduler.max_num_seqs=1"])
    cache = llm.engine.cache
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = list(range(3, 15))
    llm.generate([first], params, use_tqdm=False)
    assert cache.take_events() == []  # nothing recorded before start_events
    cache.start_events()
    second = list(range(30, 42))
    llm.generate([second], params, use_tqdm=False)
    events = cache.take_events()
    assert events[0] == KVCacheEvent("stored", tuple(block_hashes(second, BLOCK, 3)))
    llm.generate([list(range(50, 86))], params, use_tqdm=False)  # 9 blocks: evicts cached ones
    kinds = {event.kind for event in cache.take_events()}
    assert kinds == {"stored", "evicted"}
    assert cache.take_events() == []


def states(*loads: int) -> list[ReplicaState]:
    return [ReplicaState(i, load, 0, 0.0) for i, load in enumerate(loads)]


def test_kv_aware_router_prefers_the_replica_holding_the_prompt():
    router = KVAwareRouter(KVAwareRouterConfig(load_weight=2.0), RouterContext(3, BLOCK))
    prompt = list(range(100, 117))  # 4 full blocks before the last token
    hashes = block_hashes(prompt, BLOCK, 4)
    router.on_cache_events(1, [KVCacheEvent("stored", tuple(hashes[:2]))])
    router.on_cache_events(2, [KVCacheEvent("stored", tuple(hashes)), KVCacheEvent("evicted", (hashes[1],))])
    assert router.matched_tokens(prompt, 1) == 2 * BLOCK
    assert router.matched_tokens(prompt, 2) == BLOCK  # a match stops at the first block missing
    assert router.route(prompt, states(0, 0, 0)) == 1
    assert router.route(prompt, states(0, 5, 0)) == 2  # 8 cached tokens do not outweigh 5 more requests; 4 do 0
    router.on_cache_events(1, [KVCacheEvent("held", tuple(hashes))])
    assert router.matched_tokens(prompt, 1) == 4 * BLOCK
    router.on_cache_events(1, [KVCacheEvent("held", ())])
    assert router.route(prompt, states(1, 0, 3)) == 1  # replica 2's 4 tokens do not outweigh 3 requests


def test_kv_aware_router_refuses_a_negative_load_weight():
    with pytest.raises(ConfigError, match="router.load_weight must be >= 0, got -1"):
        KVAwareRouter(KVAwareRouterConfig(load_weight=-1), RouterContext(2, BLOCK))


def test_blocks_evicted_to_a_host_tier_are_moved_not_gone():
    llm = LLM("toy", overrides=["cache.enable_prefix_caching=true", f"cache.block_size={BLOCK}", "cache.num_blocks=10",
                                "model.max_model_len=40", "scheduler.max_num_seqs=1", "cache.host_cache_bytes=2000000"])
    cache = llm.engine.cache
    cache.start_events()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = list(range(3, 15))
    llm.generate([first], params, use_tqdm=False)
    llm.generate([list(range(50, 86))], params, use_tqdm=False)  # 10 blocks: the first prompt's leave the device
    events = cache.take_events()
    moved = {h for e in events if e.kind == "moved" for h in e.hashes}
    assert {e.tier for e in events if e.kind == "moved"} == {"host"}
    assert set(block_hashes(first, BLOCK, 2)) <= moved
    assert not any(e.kind == "evicted" for e in events)
    router = KVAwareRouter(KVAwareRouterConfig(load_weight=0.0, tier_weight=0.5), RouterContext(2, BLOCK))
    router.on_cache_events(0, events)
    router.on_cache_events(1, [KVCacheEvent("stored", tuple(block_hashes(first, BLOCK, 2)))])
    assert router.matched_tokens(first, 0) == BLOCK  # two blocks on the host at half weight
    assert router.matched_tokens(first, 1) == 2 * BLOCK
    assert router.route(first, states(0, 0)) == 1
    llm.generate([first], params, use_tqdm=False)  # loaded back onto the device
    router.on_cache_events(0, cache.take_events())
    assert router.matched_tokens(first, 0) == 2 * BLOCK
