"""Sampling: seeded reproducibility, top_k=1 = greedy, filters, penalties, stop rules, n."""

from __future__ import annotations

import pytest

from servelab import LLM, SamplingParams


@pytest.fixture(scope="module")
def toy() -> LLM:
    """The in-memory random model."""
    return LLM("toy", overrides=["device=cpu"])


def _tokens(outputs):
    return [c.token_ids for o in outputs for c in o.outputs]


def test_seeded_sampling_is_reproducible_and_batch_independent(toy):
    prompt = "The seed decides"
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=20)
    alone = _tokens(toy.generate(prompt, params, use_tqdm=False))
    crowd = toy.generate(["other prompt one", prompt, "x" * 30, "another"],
                         [SamplingParams(temperature=0.9, max_tokens=25), params,
                          SamplingParams(temperature=1.3, seed=7, max_tokens=5), SamplingParams(max_tokens=30)],
                         use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone[0]
    again = _tokens(toy.generate(prompt, params, use_tqdm=False))
    assert again == alone
    other_seed = _tokens(toy.generate(prompt, SamplingParams(temperature=1.0, seed=99, max_tokens=20), use_tqdm=False))
    assert other_seed != alone


def test_top_k_one_equals_greedy(toy):
    prompts = ["abc", "def fibonacci(n):", "z"]
    greedy = _tokens(toy.generate(prompts, SamplingParams(temperature=0.0, max_tokens=15), use_tqdm=False))
    top1 = _tokens(toy.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=15), use_tqdm=False))
    assert top1 == greedy


def test_tiny_top_p_and_high_min_p_are_greedy(toy):
    prompts = ["hello", "world"]
    greedy = _tokens(toy.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False))
    top_p = _tokens(toy.generate(prompts, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=10), use_tqdm=False))
    min_p = _tokens(toy.generate(prompts, SamplingParams(temperature=1.0, min_p=1.0, max_tokens=10), use_tqdm=False))
    assert top_p == greedy and min_p == greedy


def test_repetition_penalties_change_greedy_output(toy):
    base = _tokens(toy.generate("aaaa", SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False))[0]
    penalised = _tokens(toy.generate("aaaa", SamplingParams(temperature=0.0, max_tokens=30,
                                                             frequency_penalty=2.0, presence_penalty=2.0),
                                     use_tqdm=False))[0]
    assert len(set(penalised)) > len(set(base))
    assert max(penalised.count(t) for t in set(penalised)) <= max(base.count(t) for t in set(base))


def test_stop_token_ids_and_max_tokens(toy):
    full = toy.generate("stop here", SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop_at = full.token_ids[5]
    first = full.token_ids.index(stop_at)
    stopped = toy.generate("stop here", SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == full.token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at


def test_stop_strings_cut_the_text(toy):
    full = toy.generate("abc", SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    stop = full.text[6:8]
    cut = toy.generate("abc", SamplingParams(temperature=0.0, max_tokens=20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    kept = toy.generate("abc", SamplingParams(temperature=0.0, max_tokens=20, stop=[stop],
                                              include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_min_tokens_suppresses_eos(toy):
    eos = toy.get_tokenizer().eos_token_id
    out = toy.generate("x", SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, stop_token_ids=[eos]),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and eos not in out.token_ids


def test_n_returns_n_distinct_samples(toy):
    out = toy.generate("many", SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert toy.engine.cache.usage.used_blocks == 0


def test_logprobs_are_returned_for_each_token(toy):
    out = toy.generate("lp", SamplingParams(temperature=0.0, max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1 and entry[token].logprob <= 0
        assert len(entry) >= 3
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_ignore_eos_runs_to_max_tokens(toy):
    eos = toy.get_tokenizer().eos_token_id
    out = toy.generate([[eos, eos]], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 9 and out.finish_reason == "length"


def test_logit_bias_is_clamped_and_added_before_sampling(toy):
    assert SamplingParams(logit_bias={5: 250, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    (plain,) = _tokens(toy.generate("abc", greedy, use_tqdm=False))
    forced = SamplingParams(temperature=0.8, seed=1, max_tokens=6, logit_bias={7: 100})
    assert _tokens(toy.generate("abc", forced, use_tqdm=False)) == [[7] * 6]
    banned = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={plain[0]: -100})
    (moved,) = _tokens(toy.generate("abc", banned, use_tqdm=False))
    assert moved[0] != plain[0] and plain[0] not in moved


def test_logit_bias_holds_under_speculative_verification():
    ngram = LLM("toy", overrides=["device=cpu", "decoding=ngram"])
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, seed=1, max_tokens=8, logit_bias={7: 100})
        assert _tokens(ngram.generate("abc abc abc", params, use_tqdm=False)) == [[7] * 8]


@pytest.mark.parametrize("extra, plain", [
    ({}, True), ({"top_k": 1, "temperature": 0.7}, True), ({"temperature": 0.7}, False), ({"logprobs": 0}, False),
    ({"logit_bias": {3: 1.0}}, False), ({"min_tokens": 2}, False), ({"repetition_penalty": 1.2}, False),
    ({"presence_penalty": 0.5}, False)])
def test_plain_argmax_is_greedy_with_nothing_else_asked(extra, plain):
    """The sampling strategy's greedy fast path (argmax of the raw logits) applies to these alone."""
    assert SamplingParams(**{"temperature": 0.0, **extra}).plain_argmax is plain
