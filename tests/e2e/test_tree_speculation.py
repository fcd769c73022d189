"""Token-tree speculation: greedy output equal to transformers for static and dynamic
draft trees and n-gram trees, under every attention backend and cache, with prefix
caching, chunked scheduling and preemption; the kept paths are compacted in the cache."""

from __future__ import annotations

import itertools

import pytest

from servelab import LLM
from servelab.testing import assert_engine_matches_transformers, mixed_prompts, tiny_checkpoint

BASE = ["model.dtype=float32", "device=cpu", "cache.block_size=4"]
STATIC = "decoding.tree=[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]"
WIDE = ("decoding.tree=[[0],[1],[2],[0,0],[0,1],[0,2],[1,0],[1,1],[0,0,0],[0,0,1],[0,1,0],[0,0,0,0],[0,0,0,1],"
        "[0,0,0,0,0]]")


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> str:
    """A draft that shares the tokenizer but not the weights (acceptance near 0)."""
    return tiny_checkpoint(tmp_path_factory.mktemp("draft") / "draft", "llama", seed=123)


def run(folder, overrides, step_recorder, **kwargs) -> tuple[LLM, int, int, list]:
    """``assert_engine_matches_transformers`` on a new LLM: the LLM, the draft tokens
    proposed and accepted, and every step's statistics."""
    llm = LLM(folder, overrides=["model.dtype=float32", "device=cpu", *overrides])
    recorder = step_recorder(llm.engine)
    assert_engine_matches_transformers(folder, overrides, llm=llm, **kwargs)
    strategy = llm.engine.strategy
    if hasattr(strategy, "draft"):
        assert not strategy.draft.sequences and strategy.draft.cache.usage.used_blocks == 0
    stats = recorder.stats
    return llm, sum(s.spec_proposed for s in stats), sum(s.spec_accepted for s in stats), stats


@pytest.mark.parametrize("attention", ["naive", "sdpa", "cpu"])
def test_static_tree_self_draft_accepts_a_whole_path(llama, attention, step_recorder):
    _, proposed, accepted, _ = run(llama, [*BASE, f"attention={attention}", "decoding=speculative",
                                           f"decoding.draft_path={llama}", STATIC], step_recorder, max_tokens=16)
    assert proposed > 0 and accepted > 0.4 * proposed  # a whole depth-3 path of 6 nodes


@pytest.mark.parametrize("tree", [STATIC, "decoding.tree_nodes=8"])
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_trees_from_a_random_draft_match_greedy(llama, random_draft, tree, cache, step_recorder):
    _, proposed, accepted, _ = run(llama, [*BASE, f"cache={cache}", "decoding=speculative",
                                           f"decoding.draft_path={random_draft}", tree], step_recorder, max_tokens=16)
    assert proposed > 0


def test_dynamic_tree_with_prefix_caching_and_chunked_scheduling(llama, step_recorder):
    """A tree of N nodes costs N tokens of the chunked scheduler's budget."""
    shared = mixed_prompts(257, lengths=(9,))[0]
    prompts = [shared + p for p in mixed_prompts(258, lengths=(3, 11, 6))] + [shared]
    _, _, _, stats = run(llama, [*BASE, "cache.enable_prefix_caching=true", "scheduler=chunked",
                                 "scheduler.token_budget=20", "decoding=speculative", f"decoding.draft_path={llama}",
                                 "decoding.tree_nodes=6", "decoding.tree_depth=3", "decoding.tree_top_k=2"],
                         step_recorder, prompts=prompts, max_tokens=14)
    assert any(s.spec_proposed for s in stats)
    assert all(s.num_prefill_tokens + s.num_decode_tokens + s.spec_proposed <= 20 for s in stats)


@pytest.mark.parametrize("tree", [WIDE, "decoding.tree_nodes=14"])
def test_trees_up_to_max_model_len(llama, tree, step_recorder):
    """Near max_model_len the tree is cut to the positions left, in the target's cache and
    in the draft's (a dynamic tree drafts more nodes than it keeps)."""
    run(llama, [*BASE, "model.max_model_len=40", "decoding=speculative", f"decoding.draft_path={llama}", tree,
                "decoding.tree_depth=6", "decoding.tree_top_k=3"], step_recorder,
        prompts=mixed_prompts(257, lengths=(30, 27, 29)), max_tokens=10)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_trees_under_preemption(llama, random_draft, mode, step_recorder):
    llm, _, _, _ = run(llama, [*BASE, "model.max_model_len=96", "cache.num_blocks=24",
                               "cache.swap_space_bytes=10000000", f"scheduler.preemption={mode}",
                               "decoding=speculative", f"decoding.draft_path={random_draft}", STATIC],
                       step_recorder, prompts=mixed_prompts(257, lengths=(30, 31, 29, 28, 27)), max_tokens=12)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("attention", ["sdpa", "cpu"])
def test_ngram_tree_matches_greedy(llama, attention, step_recorder):
    repetitive = [[5, 9, 13, 2, 5, 9, 7, 1, 5, 9, 13, 8] * 2, list(itertools.islice(itertools.cycle([5, 9, 13]), 20))]
    prompts = mixed_prompts(257, lengths=(3, 30)) + repetitive
    _, proposed, _, _ = run(llama, [*BASE, f"attention={attention}", "decoding=ngram",
                                    "decoding.num_speculative_tokens=3", "decoding.branches=3"],
                            step_recorder, prompts=prompts, max_tokens=16)
    assert proposed > 0
