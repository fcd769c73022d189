"""Adapter-aware admission and the unified adapter pool end to end: requests of three
adapters and the base model through one adapter slot never need a split step under any
batching scheduler or policy, and greedy output still equals ``peft``'s merged models;
with adapters paged in the KV cache's block pool, KV pressure takes idle adapters' pages
back and every block and page is returned."""

from __future__ import annotations

import pytest

from servelab import SamplingParams
from servelab.testing import assert_no_leaked_blocks
from test_lora import assert_matches, lora_llm, lora_setup  # noqa: F401 (a fixture)


@pytest.mark.parametrize("overrides", [
    ("scheduler=continuous", "scheduler.mix_prefill_decode=true", "policy=priority"),
    ("scheduler=chunked", "scheduler.token_budget=24", "policy=vtc"),
    ("scheduler=static", "scheduler.max_batch_size=4"),
    ("scheduler=dynamic", "scheduler.max_batch_size=3", "scheduler.max_wait_ms=0"),
], ids=["continuous-priority", "chunked-vtc", "static", "dynamic"])
def test_admission_keeps_each_step_within_the_slots(lora_setup, overrides):
    llm = lora_llm(lora_setup, "lora.max_adapters=1", *overrides)
    assert_matches(llm, lora_setup)
    stats = llm.engine.executor.lora_stats()
    assert stats.split_steps == 0 and stats.misses >= 3
    assert llm.engine.adapter_admission.bypasses > 0


def test_unified_pool_shares_the_kv_blocks_and_gives_every_page_back(lora_setup):
    llm = lora_llm(lora_setup, "lora.unified_pool=true", "lora.max_adapters=3", "cache.block_size=4",
                   "cache.num_blocks=72", "model.max_model_len=64", "cache.swap_space_bytes=1000000",
                   "scheduler.preemption=swap", "scheduler=chunked", "scheduler.token_budget=32")
    engine = llm.engine
    pool = engine.adapter_admission.pool
    assert_matches(llm, lora_setup)  # adapters' pages come from free KV blocks
    held = pool.stats
    assert held.adapters == 3 and engine.cache.lent_blocks == held.blocks > 0
    llm.generate(lora_setup["prompts"] * 2, SamplingParams(max_tokens=10), use_tqdm=False)  # the base model's
    stats = pool.stats
    assert stats.pressure_evictions > 0 and engine.cache.lent_blocks == stats.blocks < held.blocks
    assert engine.scheduler.num_preemptions > 0  # the pressure swapped requests out too
    assert engine.executor.lora_stats().split_steps == 0
    assert_no_leaked_blocks(llm)
    for name in list(engine.lora_adapters()):
        engine.unload_lora_adapter(name)
    llm.generate([[5, 6, 7]], use_tqdm=False)  # the next admission gives unloaded adapters' pages back
    assert engine.cache.lent_blocks == 0 and pool.stats.adapters == 0
    llm.shutdown()
