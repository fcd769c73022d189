"""A lower KV tier under executor=simulated: the same index and moves as a real run, no
content, I/O priced at the hardware's disk bandwidth and overlapped with the step."""

from __future__ import annotations

from servelab import LLM, SamplingParams
from servelab.testing.oracle import assert_no_leaked_blocks, assert_tiers_whole, hot_prefix_prompts

SIMULATED = ["executor=simulated", "cost_model=roofline", "model.max_model_len=128", "cache.block_size=4",
             "cache.num_blocks=40", "scheduler.max_num_seqs=1", "cache.enable_prefix_caching=true",
             "cache.host_cache_bytes=20000"]


def run(tmp_path, *extra: str) -> LLM:
    llm = LLM("toy", overrides=[*SIMULATED, "cache.lower_tier=disk", "cache.lower_tier_bytes=4000000",
                                f"cache.lower_tier_path={tmp_path}", *extra])
    for prompt in hot_prefix_prompts():
        llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert_no_leaked_blocks(llm)
    assert_tiers_whole(llm)
    return llm


def test_simulated_lower_tier_serves_hits_and_prices_its_io(tmp_path):
    fast = run(tmp_path / "fast")
    lower = fast.engine.cache.lower
    assert lower.index.hit_tokens > 0 and lower.index.stored_blocks > 0
    assert fast.engine.cache.tier_hit_tokens == {"host": fast.engine.cache.host_tier.hit_tokens,
                                                 "disk": lower.index.hit_tokens}
    assert not list((tmp_path / "fast").glob("*/*.kv"))  # a simulation keeps no content
    slow = run(tmp_path / "slow", "hardware.disk_bandwidth=1.0e3")
    assert slow.engine.cache.lower.index.hit_tokens == lower.index.hit_tokens
    assert slow.engine.clock.now() > fast.engine.clock.now() + 1.0
