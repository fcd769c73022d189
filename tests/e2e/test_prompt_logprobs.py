"""Prompt logprobs equal transformers' log-softmax over the prompt, whatever the batching."""

from __future__ import annotations

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.core.errors import InvalidRequestError
from servelab.testing import assert_no_leaked_blocks

PROMPTS = [[5, 9, 17, 3, 22, 41, 7, 8, 100, 2, 64, 13, 71, 90, 4, 19, 33, 12, 6, 55, 11, 1, 47],
           [30, 31, 32], [200, 3, 7, 7, 7, 9, 120, 4, 6, 250, 1, 2, 3, 4, 5]]
TOP = 3


@pytest.fixture(scope="module")
def expected(llama):
    """transformers' float32 log-softmax at every prompt position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in PROMPTS]


def assert_matches(outputs, expected, top=TOP):
    for prompt, output, reference in zip(PROMPTS, outputs, expected):
        entries = output.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        for position in range(1, len(prompt)):
            row, token = reference[position - 1], prompt[position]
            entry = entries[position]
            assert entry[token].logprob == pytest.approx(float(row[token]), abs=2e-5)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            values, ids = row.topk(top)
            for rank, (value, alternative) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
                assert alternative in entry, f"prompt position {position}: top-{rank} token missing"
                assert entry[alternative].logprob == pytest.approx(value, abs=2e-5)
            assert set(entry) <= set(ids.tolist()) | {token}


@pytest.mark.parametrize("overrides", [
    [],
    ["scheduler=chunked", "scheduler.token_budget=8"],
    ["cache.enable_prefix_caching=true", "cache.block_size=4"],
    ["attention=naive", "scheduler=static"],
], ids=["continuous", "chunked-budget-8", "prefix-caching", "naive-static"])
def test_prompt_logprobs_match_transformers(llama, expected, overrides):
    """Every prompt token's logprob, rank and top alternatives, computed in the prefill
    pass (in chunks of 8 tokens too), with greedy outputs unchanged."""
    llm = LLM(llama, overrides=["model.dtype=float32", "device=cpu", *overrides])
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP)
    if "cache.enable_prefix_caching=true" in overrides:  # cached blocks must not skip prompt logprobs
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_matches(outputs, expected)
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outputs]
    assert all(o.prompt_logprobs is None for o in plain)
    assert_no_leaked_blocks(llm)


def test_prompt_logprobs_survive_preemption_and_n(llama, expected):
    """Recompute preemption in a small cache and n > 1 sequences keep one complete set."""
    llm = LLM(llama, overrides=["model.dtype=float32", "device=cpu", "cache.num_blocks=12", "cache.block_size=4",
                                "model.max_model_len=48",
                                "scheduler=chunked", "scheduler.token_budget=16"])
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, prompt_logprobs=0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert_matches(outputs, expected, top=0)
    assert all(len(o.outputs) == 2 for o in outputs)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert_no_leaked_blocks(llm)


def test_prompt_logprobs_stream_once_with_the_first_delta(llama):
    llm = LLM(llama, overrides=["model.dtype=float32", "device=cpu"])
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1), "r",
                       output_kind="delta")
    carried = []
    while engine.has_unfinished_requests():
        carried += [o.prompt_logprobs for o in engine.step() if o.request_id == "r"]
    assert carried[0] is not None and len(carried[0]) == len(PROMPTS[0])
    assert all(p is None for p in carried[1:]) and len(carried) > 1


def test_bad_prompt_logprobs_name_the_field(llama):
    for value in (-1, 21, 2.5, True):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=value)


def test_simulated_executor_refuses_prompt_logprobs():
    llm = LLM("llama-2-7b", overrides=["executor=simulated", "hardware=a100-80gb"])
    with pytest.raises(InvalidRequestError, match="prompt_logprobs.*simulated"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
