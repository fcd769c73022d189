"""Requests waiting for memory hold none of it: a waiting request whose prefix lookup found
cached blocks gives them back when the cache has no room for the rest of its prompt."""

from __future__ import annotations

import random

import pytest

from servelab import LLM, SamplingParams


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_waiting_requests_never_hold_blocks_under_pressure(index):
    llm = LLM("toy", overrides=["model.max_model_len=64", "cache.block_size=4", "cache.num_blocks=24",
                                "cache.enable_prefix_caching=true", f"cache.prefix_index={index}",
                                "scheduler.max_num_seqs=8"])
    engine = llm.engine
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 200) for _ in range(24)] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate(prefixes, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # cache them
    for i in range(16):
        engine.add_request(prefixes[i % 4] + [rng.randrange(3, 200) for _ in range(16)], params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
        held = {r.request_id: engine.cache.block_table(r) for r in engine.scheduler.waiting}
        assert not any(held.values()), f"waiting requests hold blocks: {held}"
    assert engine.cache.usage.used_blocks == 0
    assert engine.cache.prefix_hit_tokens > 0
