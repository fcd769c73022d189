"""A cache too small for the batch forces preemption; outputs stay exact and nothing leaks."""

from __future__ import annotations

import pytest

from servelab import LLM
from servelab.testing import assert_engine_matches_transformers, mixed_prompts


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_preemption_by_recompute_keeps_output_identical(llama, scheduler):
    """24 blocks of 4 tokens are full after three ~30-token prompts; decoding must preempt."""
    overrides = [f"scheduler={scheduler}", "model.max_model_len=96", "cache=paged", "cache.block_size=4",
                 "cache.num_blocks=24"]
    if scheduler == "continuous":
        overrides.append("scheduler.max_num_batched_tokens=96")
    else:
        overrides.append("scheduler.max_num_batched_tokens=200")
    llm = LLM(llama, overrides=["model.dtype=float32", *overrides])
    prompts = mixed_prompts(llm.engine.vocab_size, lengths=(30, 31, 29, 28, 27))
    assert_engine_matches_transformers(llama, prompts=prompts, llm=llm)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.cache.num_free_blocks == 24


def test_contiguous_cache_queues_when_full(llama):
    """Two reservations for five prompts: requests wait for a region, output is exact."""
    llm = LLM(llama, overrides=["model.dtype=float32", "model.max_model_len=96", "cache=contiguous",
                                "cache.num_slots=2"])
    assert_engine_matches_transformers(llama, llm=llm)
    assert llm.engine.cache.num_free_blocks == 2


def test_swap_in_and_out_in_one_step_keep_output_identical(llama):
    """Speculation, swapping and prefix caching on a small cache: steps that swap one
    request in and another out reuse host blocks within the step (once a wrong output:
    the swap-out overwrote the host blocks before the swap-in read them)."""
    llm = LLM(llama, overrides=["model.dtype=float32", "device=cpu", "cache.block_size=4", "cache.num_blocks=40",
                                "model.max_model_len=128", "decoding=ngram", "cache.swap_space_bytes=1000000",
                                "scheduler.preemption=swap", "cache.enable_prefix_caching=true"])
    steps = []
    schedule = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    assert_engine_matches_transformers(llama, llm=llm)
    assert any(o.blocks_to_swap_in and o.blocks_to_swap_out for o in steps)
