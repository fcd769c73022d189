"""``cache.prefix_index=radix``: token-level prefix matching copies the shared leading
tokens of a block, keeps greedy output equal to transformers and leaks nothing."""

from __future__ import annotations

import random

import pytest

from servelab import LLM, ConfigError, SamplingParams
from servelab.testing import run_stress, tiny_checkpoint
from servelab.testing.oracle import assert_engine_matches_transformers
from servelab.testing.stress import STRESS_CACHE

ENGINE = ["model.dtype=float32", "device=cpu", "model.max_model_len=128", "cache.block_size=8",
          "cache.enable_prefix_caching=true"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("radix") / "llama", "llama")


def diverging_prompts() -> list[list[int]]:
    """Prompts sharing a 37-token start up to points inside its blocks, then their own."""
    rng = random.Random(0)
    base = [rng.randrange(3, 200) for _ in range(37)]
    return [base[:k] + [rng.randrange(3, 200) for _ in range(5)] for k in (37, 30, 21, 10, 3, 37, 25, 12)]


def hits(llm: LLM) -> tuple[int, int]:
    """Prefix tokens found and, of them, those copied from inside a block."""
    prefix = llm.engine.cache.prefix
    return llm.engine.cache.prefix_hit_tokens, getattr(prefix, "partial_hit_tokens", 0)


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_radix_reuses_tokens_inside_blocks_and_matches_transformers(checkpoint, one_at_a_time):
    prompts = diverging_prompts()
    found = {}
    for index in ("hash", "radix"):
        llm = LLM(checkpoint, overrides=[*ENGINE, f"cache.prefix_index={index}",
                                         *(["scheduler.max_num_seqs=1"] if one_at_a_time else [])])
        assert_engine_matches_transformers(checkpoint, prompts=prompts, max_tokens=8, llm=llm)
        found[index] = hits(llm)
    assert found["hash"][1] == 0
    if one_at_a_time:  # every prompt finds the earlier ones cached
        assert found["radix"][1] > 0 and found["radix"][0] > found["hash"][0]


def test_radix_under_preemption_and_forks(checkpoint):
    llm = LLM(checkpoint, overrides=[*ENGINE, "cache.prefix_index=radix", "cache.block_size=4",
                                     "cache.num_blocks=40", "scheduler.max_num_seqs=3"])
    prompts = diverging_prompts()
    assert_engine_matches_transformers(checkpoint, prompts=prompts, max_tokens=20, llm=llm)
    outputs = llm.generate(prompts[:3], SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=6), use_tqdm=False)
    assert all(len(o.outputs) == 3 for o in outputs)
    assert llm.engine.cache.usage.used_blocks == 0
    assert llm.engine.cache.prefix.tree_size > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_radix_stress_with_aborts_holds_no_block(checkpoint, mode):
    report = run_stress(["model=local", f"model.path={checkpoint}", *ENGINE[:3], *STRESS_CACHE,
                         "cache.prefix_index=radix", f"scheduler.preemption={mode}"], num_requests=50, seed=5)
    assert report.num_finished + report.num_aborted == report.num_requests
    assert report.prefix_hit_tokens > 0


def test_unknown_prefix_index_names_the_field():
    with pytest.raises(ConfigError, match="cache.prefix_index must be one of hash, radix, got 'tree'"):
        LLM("toy", overrides=["cache.enable_prefix_caching=true", "cache.prefix_index=tree"])
