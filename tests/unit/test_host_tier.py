"""``cache.host_cache_bytes``: cached prefix blocks evicted from the device move to a host
tier and come back on a hit, with greedy output unchanged and nothing leaked."""

from __future__ import annotations

import pytest

from servelab import LLM, ConfigError, SamplingParams
from servelab.testing import run_stress, tiny_checkpoint
from servelab.testing.oracle import assert_no_leaked_blocks, assert_tiers_whole, hot_prefix_prompts, transformers_greedy
from servelab.testing.stress import STRESS_CACHE

ENGINE = ["model.dtype=float32", "device=cpu", "model.max_model_len=128", "cache.block_size=4",
          "cache.enable_prefix_caching=true"]
TIER = "cache.host_cache_bytes=2000000"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tier") / "llama", "llama")


def test_evicted_prefixes_come_back_from_the_host_tier(checkpoint):
    prompts = hot_prefix_prompts()
    expected = transformers_greedy(checkpoint, prompts, 4)
    found = {}
    for name, extra in (("device", []), ("host", [TIER])):
        llm = LLM(checkpoint, overrides=[*ENGINE, "cache.num_blocks=40", "scheduler.max_num_seqs=1", *extra])
        got = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
               for p in prompts]
        assert got == expected, name
        assert_no_leaked_blocks(llm)
        found[name] = llm.engine.cache.prefix_hit_tokens
    tier = llm.engine.cache.host_tier
    assert tier.hit_tokens > 0 and tier.stored_blocks > 0
    assert found["host"] == found["device"] + tier.hit_tokens
    assert_tiers_whole(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_host_tier_stress_with_aborts_holds_no_block(checkpoint, mode):
    report = run_stress(["model=local", f"model.path={checkpoint}", *ENGINE[:3], *STRESS_CACHE, TIER,
                         "cache.prefix_index=radix", f"scheduler.preemption={mode}"], num_requests=50, seed=7)
    assert report.num_finished + report.num_aborted == report.num_requests


def test_batched_steps_with_the_host_tier_match_transformers(checkpoint):
    prompts = hot_prefix_prompts()
    expected = transformers_greedy(checkpoint, prompts, 6)
    llm = LLM(checkpoint, overrides=[*ENGINE, "cache.num_blocks=48", "scheduler.max_num_seqs=4", TIER])
    for start in range(0, len(prompts), 4):
        batch = prompts[start:start + 4]
        outputs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected[start:start + 4]
    assert llm.engine.cache.host_tier.hit_tokens > 0
    assert_no_leaked_blocks(llm)
    assert_tiers_whole(llm)


@pytest.mark.parametrize("overrides,problem", [
    ([TIER], "cache.host_cache_bytes keeps evicted prefix blocks: set cache.enable_prefix_caching=true"),
    (["cache.enable_prefix_caching=true", "cache.host_cache_bytes=10"], "cache.host_cache_bytes=10 holds no block"),
])
def test_bad_host_tier_settings_name_the_field(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        LLM("toy", overrides=overrides)


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_speculative_decoding_over_the_host_tier_keeps_greedy_output(checkpoint, index):
    prompts = hot_prefix_prompts()
    expected = transformers_greedy(checkpoint, prompts, 8)
    llm = LLM(checkpoint, overrides=[*ENGINE, "cache.num_blocks=40", "scheduler.max_num_seqs=1", TIER,
                                     f"cache.prefix_index={index}", "decoding=ngram"])
    got = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
           for p in prompts]
    assert got == expected
    assert llm.engine.cache.host_tier.hit_tokens > 0
    assert_no_leaked_blocks(llm)
