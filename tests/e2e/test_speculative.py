"""Speculative decoding: exact greedy output, the target's distribution, no leaked blocks."""

from __future__ import annotations

import itertools

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.testing import assert_engine_matches_transformers, mixed_prompts, tiny_checkpoint

BASE = ["model.dtype=float32", "device=cpu", "cache.block_size=4"]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory) -> str:
    """A draft that shares the tokenizer but not the weights (acceptance near 0)."""
    return tiny_checkpoint(tmp_path_factory.mktemp("draft") / "draft", "llama", seed=123)


def _draft_caches_empty(llm) -> bool:
    draft = llm.engine.strategy.draft
    return not draft.sequences and draft.cache.usage.used_blocks == 0


def matches_transformers_counting_drafts(folder, overrides, step_recorder, **kwargs) -> tuple[LLM, int, int]:
    """``assert_engine_matches_transformers`` on a new LLM; returns it with the draft
    tokens proposed and accepted over the run (from the steps' statistics)."""
    llm = LLM(folder, overrides=["model.dtype=float32", "device=cpu", *overrides])
    recorder = step_recorder(llm.engine)
    assert_engine_matches_transformers(folder, overrides, llm=llm, **kwargs)
    return llm, sum(s.spec_proposed for s in recorder.stats), sum(s.spec_accepted for s in recorder.stats)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_draft_accepts_everything_and_matches_greedy(llama, k, step_recorder):
    llm, proposed, accepted = matches_transformers_counting_drafts(
        llama, [*BASE, "decoding=speculative", f"decoding.draft_path={llama}", f"decoding.num_speculative_tokens={k}"],
        step_recorder, max_tokens=16)
    assert proposed > 0 and accepted == proposed
    assert _draft_caches_empty(llm)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_random_draft_is_rejected_but_output_is_exact(llama, random_draft, k, step_recorder):
    llm, proposed, accepted = matches_transformers_counting_drafts(
        llama, [*BASE, "decoding=speculative", f"decoding.draft_path={random_draft}",
                f"decoding.num_speculative_tokens={k}"], step_recorder, max_tokens=16)
    assert accepted / proposed < 0.2
    assert _draft_caches_empty(llm)


@pytest.mark.parametrize("scheduler", ["continuous", "chunked"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_matches_greedy(llama, scheduler, k, step_recorder):
    repetitive = [list(itertools.islice(itertools.cycle([5, 9, 13, 2]), n)) for n in (12, 30)]
    prompts = mixed_prompts(257, lengths=(3, 40)) + repetitive
    overrides = [*BASE, "decoding=ngram", f"decoding.num_speculative_tokens={k}", f"scheduler={scheduler}"]
    if scheduler == "chunked":
        overrides.append("scheduler.token_budget=24")
    _, proposed, _ = matches_transformers_counting_drafts(llama, overrides, step_recorder, prompts=prompts,
                                                          max_tokens=16)
    assert proposed > 0


def test_mixed_sampling_parameters_share_a_batch(llama):
    llm = LLM(llama, overrides=[*BASE, "decoding=speculative", f"decoding.draft_path={llama}",
                                "decoding.num_speculative_tokens=3"])
    prompts = mixed_prompts(257, lengths=(5, 12, 20, 8))
    params = [SamplingParams(temperature=0.0, max_tokens=10), SamplingParams(temperature=0.8, top_p=0.9, seed=1,
              max_tokens=12), SamplingParams(temperature=1.2, top_k=20, seed=2, max_tokens=9, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=7, stop_token_ids=[3])]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    greedy = LLM(llama, overrides=BASE).generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=10),
                                                 use_tqdm=False)[0]
    assert outputs[0].outputs[0].token_ids == greedy.outputs[0].token_ids
    assert [len(o.outputs[0].token_ids) for o in outputs[1:3]] == [12, 9]
    assert len(outputs[2].outputs[0].logprobs) == 9
    assert llm.engine.cache.usage.used_blocks == 0 and _draft_caches_empty(llm)
    assert outputs[0].metrics.spec_accepted_tokens > 0


def test_aborts_mid_speculation_leak_nothing(llama, random_draft):
    llm = LLM(llama, overrides=[*BASE, "decoding=speculative", f"decoding.draft_path={random_draft}",
                                "decoding.num_speculative_tokens=4"])
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
           for p in mixed_prompts(257, lengths=(10, 20, 30))]
    for _ in range(4):
        engine.step()
    assert engine.strategy.draft.cache.usage.used_blocks > 0
    engine.abort_request(ids)
    assert engine.cache.usage.used_blocks == 0 and _draft_caches_empty(llm)


CHI2_CRITICAL_63_DOF = 103.5
"""Upper 0.1% point of chi-square with 63 degrees of freedom (Wilson-Hilferty): a correct
sampler fails the test with probability 0.001 for a given seed; the seeds are fixed."""


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> tuple[str, str]:
    """A target and an unrelated draft over an 8-token vocabulary."""
    root = tmp_path_factory.mktemp("small")
    return (tiny_checkpoint(root / "target", "llama", seed=1, vocab_size=8),
            tiny_checkpoint(root / "draft", "llama", seed=2, vocab_size=8))


def _exact_joint(folder: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        second = torch.stack([model(torch.tensor([prompt + [t]])).logits[0, -1].softmax(-1) for t in range(8)])
    return (first[:, None] * second).flatten()


SIBLINGS = "decoding.tree=[[0],[1],[2],[0,0],[1,0]]"
"""A static tree whose root has three children drawn without replacement from the draft."""


@pytest.mark.parametrize("draft_kind, shape", [("good", "decoding.num_speculative_tokens=2"),
                                               ("bad", "decoding.num_speculative_tokens=2"),
                                               ("good", SIBLINGS), ("bad", SIBLINGS),
                                               ("bad", "decoding.tree_nodes=5")])
def test_sampling_rule_preserves_the_target_distribution(small_vocab, draft_kind, shape, step_recorder):
    target, bad_draft = small_vocab
    draft = target if draft_kind == "good" else bad_draft
    prompt = [1, 5, 2, 7]
    llm = LLM(target, overrides=[*BASE, "decoding=speculative", f"decoding.draft_path={draft}", shape,
                                 "scheduler.max_num_seqs=512"])
    recorder = step_recorder(llm.engine)
    samples = 2000
    outputs = llm.generate([prompt] * samples, [SamplingParams(temperature=1.0, seed=s, max_tokens=2, ignore_eos=True)
                                                for s in range(samples)], use_tqdm=False)
    counts = torch.zeros(64)
    for out in outputs:
        first, second = out.outputs[0].token_ids
        counts[first * 8 + second] += 1
    expected = _exact_joint(target, prompt) * samples
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRITICAL_63_DOF, (draft_kind, shape, chi2)
    accepted = sum(s.spec_accepted for s in recorder.stats)
    proposed = sum(s.spec_proposed for s in recorder.stats)
    steps = sum(1 for s in recorder.stats if s.spec_proposed)
    assert accepted / steps > 0.99 if draft_kind == "good" else accepted / proposed < 0.9


def test_prefix_hit_leaving_one_prompt_token_drafts_nothing(llama):
    # Admitted with all but its last token cached, a request gets no lookahead slots;
    # drafting for it wrote past its blocks into shared prefix blocks.
    shared = mixed_prompts(257, lengths=(9,))[0]
    prompts = [shared + p for p in mixed_prompts(258, lengths=(3, 11, 6))] + [shared]
    assert_engine_matches_transformers(llama, [*BASE, "cache.enable_prefix_caching=true", "decoding=speculative",
                                               f"decoding.draft_path={llama}", "decoding.num_speculative_tokens=6"],
                                       prompts=prompts, max_tokens=8)
