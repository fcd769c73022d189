"""Chunked prefill, swap preemption, prefix caching and shared blocks for n > 1."""

from __future__ import annotations

import pytest

from servelab import LLM, SamplingParams
from servelab.testing import assert_engine_matches_transformers, mixed_prompts

BASE = ["model.dtype=float32", "device=cpu"]


def test_chunked_prefill_never_stalls_decodes_and_respects_budget(llama, step_recorder):
    budget = 16
    llm = LLM(llama, scheduler="chunked", overrides=[*BASE, f"scheduler.token_budget={budget}"])
    recorder = step_recorder(llm.engine)
    prompts = mixed_prompts(llm.engine.vocab_size, lengths=(5, 6, 90, 7, 60))
    assert_engine_matches_transformers(llama, prompts=prompts, max_tokens=20, llm=llm)
    samples: dict[str, int] = {}
    decoding: set[str] = set()
    checked = 0
    for output in recorder.outputs:
        assert output.num_tokens <= budget
        granted = {g.request.request_id for g in output.scheduled}
        if any(not g.samples for g in output.scheduled):
            checked += bool(decoding)
            assert decoding <= granted, "a running decode was stalled by a prefill chunk"
        for g in output.scheduled:
            if g.samples:
                samples[g.request.request_id] = samples.get(g.request.request_id, 0) + 1
        decoding = {g.request.request_id for g in output.scheduled
                    if g.samples and samples[g.request.request_id] < len(g.request.output_token_ids)}
    assert checked > 0, "no prefill chunk ran next to a decode"


@pytest.mark.parametrize("scheduler", ["continuous", "chunked", "static"])
def test_swap_preemption_keeps_output_identical_and_frees_both_pools(llama, scheduler):
    overrides = [*BASE, f"scheduler={scheduler}", "scheduler.preemption=swap", "model.max_model_len=96",
                 "cache.block_size=4", "cache.num_blocks=24", "cache.swap_space_bytes=10000000"]
    if scheduler == "continuous":
        overrides.append("scheduler.max_num_batched_tokens=96")
    llm = LLM(llama, overrides=overrides)
    prompts = mixed_prompts(llm.engine.vocab_size, lengths=(30, 31, 29, 28, 27))
    assert_engine_matches_transformers(llama, prompts=prompts, llm=llm)
    cache = llm.engine.cache
    assert llm.engine.scheduler.num_preemptions > 0
    assert cache.host_pool.num_free == cache.num_host_blocks > 0
    assert cache.num_free_blocks == 24


def test_swap_falls_back_to_recompute_when_host_pool_is_full(llama):
    llm = LLM(llama, overrides=[*BASE, "scheduler.preemption=swap", "model.max_model_len=96",
                                "scheduler.max_num_batched_tokens=96", "cache.block_size=4", "cache.num_blocks=24",
                                "cache.swap_space_bytes=4096"])
    prompts = mixed_prompts(llm.engine.vocab_size, lengths=(30, 31, 29, 28, 27))
    assert_engine_matches_transformers(llama, prompts=prompts, llm=llm)
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_reuses_blocks_with_identical_output(llama, step_recorder):
    llm = LLM(llama, overrides=[*BASE, "cache.enable_prefix_caching=true", "cache.block_size=4"])
    shared = mixed_prompts(llm.engine.vocab_size, lengths=(41,), seed=5)[0]
    first, second = shared + [1, 2, 3], shared + [9, 8]
    recorder = step_recorder(llm.engine)
    assert_engine_matches_transformers(llama, prompts=[first], llm=llm)
    out = llm.generate([second], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert out.metrics.num_cached_prompt_tokens == 40
    assert llm.engine.cache.prefix_hit_tokens == 40
    assert sum(s.prefix_hit_tokens for s in recorder.stats) == 40
    assert all(0.0 <= s.kv.waste < 1.0 for s in recorder.stats if s.kv.reserved_slots)
    computed_at_admission = [g.num_computed_tokens for o in recorder.outputs for g in o.scheduled
                             if g.request.prompt_token_ids == second]
    assert computed_at_admission[0] == 40
    assert_engine_matches_transformers(llama, prompts=[second], llm=llm)
    assert llm.engine.cache.usage.cached_blocks > 0


def test_prefix_cache_evicts_under_pressure_and_stays_correct(llama):
    llm = LLM(llama, overrides=[*BASE, "cache.enable_prefix_caching=true", "cache.block_size=4",
                                "cache.num_blocks=40", "model.max_model_len=96",
                                "scheduler.max_num_batched_tokens=96"])
    prompts = mixed_prompts(llm.engine.vocab_size, lengths=(60, 50, 70, 45), seed=11)
    for _ in range(2):
        assert_engine_matches_transformers(llama, prompts=prompts, llm=llm)
    repeat = [prompts[-1][:40] + [5, 6, 7]]
    assert_engine_matches_transformers(llama, prompts=repeat, llm=llm)
    assert llm.engine.cache.prefix.hit_tokens > 0


def test_parallel_sampling_shares_prompt_blocks(llama, step_recorder):
    prompt = mixed_prompts(257, lengths=(64,), seed=2)[0]
    params = SamplingParams(n=4, temperature=0.0, max_tokens=6)

    def peak_blocks(prompts, params):
        llm = LLM(llama, overrides=[*BASE, "cache.block_size=4"])
        recorder = step_recorder(llm.engine)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.cache.usage.used_blocks == 0
        assert all(0 <= s.kv.used_slots <= s.kv.reserved_slots for s in recorder.stats), "shared slots counted twice"
        return max(s.kv.used_blocks for s in recorder.stats), [c.token_ids for o in outputs for c in o.outputs]

    shared_peak, shared = peak_blocks([prompt], params)
    separate_peak, separate = peak_blocks([prompt] * 4, SamplingParams(temperature=0.0, max_tokens=6))
    expected = assert_engine_matches_transformers(llama, prompts=[prompt], max_tokens=6).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    assert shared == separate == [expected] * 4
    assert shared_peak <= 16 + 4 * 2 < 4 * 16 <= separate_peak


def test_parallel_sampling_children_sample_independently(llama):
    llm = LLM(llama, overrides=[*BASE, "cache.block_size=4"])
    out = llm.generate([[5] * 30], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert llm.engine.cache.usage.used_blocks == 0


def test_dynamic_scheduler_waits_for_batch_or_timeout(llama, step_recorder):
    llm = LLM(llama, scheduler="dynamic", overrides=[*BASE, "scheduler.max_batch_size=3",
                                                      "scheduler.max_wait_ms=30"])
    recorder = step_recorder(llm.engine)
    prompts = mixed_prompts(llm.engine.vocab_size, lengths=(5, 6, 7, 8))
    assert_engine_matches_transformers(llama, prompts=prompts, llm=llm)
    batches = [len(o.scheduled) for o in recorder.outputs if o.scheduled and o.num_prefill_tokens]
    assert batches == [3, 1]


def test_beam_search_width_one_equals_greedy(llama):
    llm = LLM(llama, overrides=[*BASE, "cache.block_size=4"])
    prompts = mixed_prompts(llm.engine.vocab_size)
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    beam = llm.generate(prompts, SamplingParams(use_beam_search=True, temperature=0.0, max_tokens=10),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in beam] == [o.outputs[0].token_ids for o in greedy]


def test_beam_search_matches_transformers_and_shares_blocks(llama, step_recorder):
    """Beams are ordinary requests; the prefix cache shares their common blocks."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(llama, overrides=[*BASE, "cache.block_size=4", "cache.enable_prefix_caching=true"])
    recorder = step_recorder(llm.engine)
    prompt = mixed_prompts(llm.engine.vocab_size, lengths=(48,), seed=4)[0]
    out = llm.generate([prompt], SamplingParams(use_beam_search=True, temperature=0.0, n=2, best_of=4,
                                                max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    reference = model.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=2, max_new_tokens=8,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
    assert [c.token_ids for c in out.outputs] == [s[len(prompt):].tolist() for s in reference]
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    blocks_per_beam = -(-(48 + 8) // 4)
    assert max(s.kv.used_blocks for s in recorder.stats) < 2 * blocks_per_beam < 4 * blocks_per_beam
    assert llm.engine.cache.usage.used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_continuous_budget_defaults_to_2048_tokens_per_step(llama, step_recorder):
    """Unset, ``max_num_batched_tokens`` caps steps at 2048 tokens: a burst of prompts
    prefills over several steps and every request still completes."""
    llm = LLM(llama, overrides=BASE)
    assert llm.engine.scheduler.token_budget == 2048
    recorder = step_recorder(llm.engine)
    prompts = mixed_prompts(llm.engine.vocab_size, lengths=(100,) * 25)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 2 for o in outputs)
    prefill_steps = [o for o in recorder.outputs if o.num_prefill_tokens]
    assert len(prefill_steps) >= 2 and max(o.num_tokens for o in recorder.outputs) <= 2048
    assert sum(o.num_prefill_tokens for o in prefill_steps) == 2500


def test_continuous_budget_default_grows_to_max_model_len(tmp_path):
    """A model whose context is longer than 2048 gets a budget that holds its longest prompt."""
    import json

    from servelab.testing import tiny_checkpoint

    folder = tiny_checkpoint(tmp_path / "m", "llama")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["max_position_embeddings"] = 3000
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    llm = LLM(folder, overrides=[*BASE, "model.max_model_len=3000"])
    assert llm.engine.scheduler.token_budget == 3000


def test_step_budget_defaults_to_max_model_len_when_the_policy_sets_none(llama):
    """A scheduler without a step budget (``max_step_tokens`` None) warms up to the
    model's context length, also when ``model.max_model_len`` is unset."""
    llm = LLM(llama, overrides=["model.dtype=float32", "device=cpu"])
    engine = llm.engine
    engine.scheduler.max_step_tokens = lambda: None
    assert engine.cfg.model.max_model_len is None
    assert engine.max_step_tokens == engine.max_model_len == 256
    assert engine.warm_up(16) >= 0


@pytest.mark.parametrize("scheduler", ["continuous", "chunked"])
def test_beam_search_survives_swapping(llama, scheduler):
    """Beam requests are preempted and swapped like any request (once a crash: a beam
    was forked while its blocks were swapped out)."""
    llm = LLM(llama, scheduler=scheduler, overrides=[*BASE, "cache.block_size=4", "cache.num_blocks=48",
                                                     "model.max_model_len=128", "cache.enable_prefix_caching=true",
                                                     "cache.swap_space_bytes=4000000", "scheduler.preemption=swap"])
    prompts = mixed_prompts(llm.engine.vocab_size, lengths=(40, 33, 25, 47))
    beams = llm.generate(prompts, SamplingParams(use_beam_search=True, temperature=0.0, best_of=3, n=2,
                                                 max_tokens=12, ignore_eos=True), use_tqdm=False)
    alone = [LLM(llama, overrides=[*BASE, "cache.block_size=4"]).generate(
        [p], SamplingParams(use_beam_search=True, temperature=0.0, best_of=3, n=2, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0] for p in prompts[:1]]
    assert [c.token_ids for c in beams[0].outputs] == [c.token_ids for c in alone[0].outputs]
    assert all(len(c.token_ids) == 12 for o in beams for c in o.outputs)
    assert llm.engine.cache.usage.used_blocks == 0 and not llm.beam_search.groups
