"""KV cache groups: windowed layers give their blocks back, and greedy output still equals
transformers' under every scheduler, chunking, prefix caching, both preemption modes and
speculative decoding."""

from __future__ import annotations

import pytest

from servelab import LLM, SamplingParams
from servelab.core.errors import ConfigError
from servelab.testing import assert_engine_matches_transformers, mixed_prompts, tiny_checkpoint

WINDOW = 8
SMALL = ["cache.block_size=4", "model.max_model_len=128"]
"""Blocks of 4 tokens, so an 8-token window spans a few blocks."""


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A Mistral whose every layer attends to the last ``WINDOW`` tokens: one windowed group."""
    return tiny_checkpoint(tmp_path_factory.mktemp("mistral-window"), "mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A Gemma 3 whose layers alternate windowed and global: three groups of one layer."""
    return tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3")


def peak_used_blocks(llm: LLM, prompts: list[list[int]], max_tokens: int) -> int:
    """The most KV blocks the engine held at once while generating."""
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), f"peak-{index}")
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.cache.usage.used_blocks)
    return peak


@pytest.mark.parametrize("overrides", [
    ["scheduler=continuous"],
    ["scheduler=chunked", "scheduler.token_budget=16"],
    ["scheduler=static"],
    ["scheduler=continuous", "cache.enable_prefix_caching=true"],
    ["scheduler=chunked", "scheduler.token_budget=16", "scheduler.preemption=swap",
     "cache.swap_space_bytes=1000000", "cache.num_blocks=40"],
    ["scheduler=continuous", "scheduler.preemption=recompute", "cache.num_blocks=40"],
    ["decoding=ngram"],
    ["decoding=speculative", "decoding.draft=local", "decoding.draft_block_size=4"],
], ids=["continuous", "chunked", "static", "prefix", "swap", "recompute", "ngram", "draft"])
def test_windowed_model_matches_transformers(mistral, overrides):
    """(The draft model is the target itself, windowed too: its cache keeps groups as well.)"""
    overrides = [o if o != "decoding.draft=local" else f"decoding.draft_path={mistral}" for o in overrides]
    llm = assert_engine_matches_transformers(mistral, [*SMALL, *overrides], max_tokens=24)
    assert [group.sliding_window for group in llm.engine.cache.groups] == [WINDOW]
    llm.shutdown()


def test_windowed_prefix_hits_are_reused(mistral):
    """Prompts sharing a prefix find the window's blocks again and still match."""
    shared = mixed_prompts(257, lengths=(40,), seed=3)[0]
    prompts = [shared + tail for tail in mixed_prompts(257, lengths=(5, 9, 2), seed=4)]
    llm = LLM(mistral, overrides=["model.dtype=float32", *SMALL, "cache.enable_prefix_caching=true"])
    assert_engine_matches_transformers(mistral, prompts=prompts[:1], max_tokens=6, llm=llm)
    assert_engine_matches_transformers(mistral, prompts=prompts[1:], max_tokens=6, llm=llm)
    assert llm.engine.cache.prefix_hit_tokens >= 2 * 36
    llm.shutdown()


def test_groups_hold_fewer_blocks_than_keeping_every_token(mistral):
    """With chunked prefills a windowed request holds about its window, not its length."""
    prompts = mixed_prompts(257, lengths=(60, 45, 70), seed=1)
    peaks = {}
    for groups in ("true", "false"):
        llm = LLM(mistral, overrides=["model.dtype=float32", *SMALL, f"cache.groups={groups}", "scheduler=chunked",
                                      "scheduler.token_budget=16"])
        peaks[groups] = peak_used_blocks(llm, prompts, 30)
        llm.shutdown()
    assert peaks["true"] < peaks["false"] / 2, peaks


@pytest.mark.parametrize("attention", ["naive", "sdpa", "cpu"])
@pytest.mark.parametrize("scheduler", ["continuous", "chunked"])
def test_interleaved_groups_match_transformers(gemma3, attention, scheduler):
    llm = assert_engine_matches_transformers(
        gemma3, [*SMALL, f"attention={attention}", f"scheduler={scheduler}", "scheduler.token_budget=16",
                 "cache.enable_prefix_caching=true"] if scheduler == "chunked" else
        [*SMALL, f"attention={attention}", f"scheduler={scheduler}"], max_tokens=16)
    assert [(group.layers, group.sliding_window) for group in llm.engine.cache.groups] == [((0,), 8), ((2,), 8),
                                                                                         ((1,), None)]
    llm.shutdown()


def test_handing_off_a_grouped_cache_is_refused(gemma3):
    with pytest.raises(ConfigError, match="cache.groups=false"):
        LLM(gemma3, overrides=["model.dtype=float32", *SMALL, "role=prefill"])


def test_flash_reads_interleaved_windows(gemma3, attention_env):
    """The Triton kernels (interpreted here) with one window per layer group."""
    attention_env("flash")
    prompts = mixed_prompts(257, lengths=(3, 14))
    llm = assert_engine_matches_transformers(gemma3, [*SMALL, "attention=flash"], prompts=prompts, max_tokens=6)
    llm.shutdown()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_sliding_layers_match_transformers(tmp_path, family):
    """Qwen2 and Qwen3 with use_sliding_window: the layers from max_window_layers on attend
    through the window, the first ones globally: two groups."""
    folder = tiny_checkpoint(tmp_path / family, family, use_sliding_window=True, sliding_window=WINDOW,
                             max_window_layers=1, layer_types=["full_attention", "sliding_attention"])
    llm = assert_engine_matches_transformers(folder, [*SMALL, "scheduler=chunked", "scheduler.token_budget=16"],
                                             max_tokens=20)
    assert [group.sliding_window for group in llm.engine.cache.groups] == [None, WINDOW]
    llm.shutdown()
