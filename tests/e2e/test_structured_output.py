"""Structured output end to end on model=tiny: every output matches its constraint under
continuous and chunked batching, with n > 1, preemption and aborts, mixed with free requests."""

from __future__ import annotations

import json
import re

import pytest

from servelab import LLM, InvalidRequestError, SamplingParams, StructuredOutputParams

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "color": {"enum": ["red", "green", "blue"]},
                         "name": {"type": "string", "maxLength": 10}},
          "required": ["id", "color", "name"]}
PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\n", "# a list of colors"]


def texts(outputs) -> list[str]:
    return [c.text for o in outputs for c in o.outputs]


def assert_schema_outputs(outputs) -> None:
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion
            jsonschema.validate(json.loads(completion.text), SCHEMA)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny")


def test_a_hundred_schema_requests_in_one_batch_all_validate(llm):
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=7,
                            structured_output=StructuredOutputParams(json=SCHEMA))
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(100)], params, use_tqdm=False)
    assert_schema_outputs(outputs)
    assert len(set(texts(outputs))) > 1
    assert llm.engine.strategy.grammars.num_tracked == 0


@pytest.mark.parametrize("spec, check", [
    (StructuredOutputParams(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
    (StructuredOutputParams(regex=r"[a-z]{3}-\d{2}"), lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
    (StructuredOutputParams(grammar='root ::= "(" [0-9]+ (", " [0-9]+)? ")"'),
     lambda t: re.fullmatch(r"\(\d+(, \d+)?\)", t)),
    (StructuredOutputParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_choice_regex_grammar_and_json_object(llm, spec, check):
    params = SamplingParams(max_tokens=48, temperature=0, structured_output=spec)
    completions = [o.outputs[0] for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    if spec.kind == "json_object":   # the greedy model may grow an object past max_tokens
        completions = [c for c in completions if c.finish_reason == "stop"]
    assert completions and all(c.finish_reason == "stop" and check(c.text) for c in completions), completions


def test_n_sequences_each_follow_their_own_matcher(llm):
    params = SamplingParams(n=4, max_tokens=64, temperature=1.0, seed=3,
                            structured_output=StructuredOutputParams(json=SCHEMA))
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert_schema_outputs(outputs)
    assert len(set(texts(outputs))) > 2


def test_chunked_prefill_with_mixed_batches_and_preemption():
    """A 16-token budget splits every prompt; a 12-block cache preempts; free requests
    produce what they produce alone, constrained ones validate."""
    free = SamplingParams(max_tokens=24, temperature=0)
    constrained = SamplingParams(max_tokens=64, temperature=0, structured_output=StructuredOutputParams(json=SCHEMA))
    prompts = [p * 3 for p in PROMPTS]
    reference = texts(LLM("tiny").generate(prompts, free, use_tqdm=False))
    for preemption in ("recompute", "swap"):
        llm = LLM("tiny", scheduler="chunked", overrides=[
            "scheduler.token_budget=16", "model.max_model_len=128", "cache.block_size=4", "cache.num_blocks=40",
            f"scheduler.preemption={preemption}", "cache.swap_space_bytes=4000000"])
        outputs = llm.generate(prompts * 2, [free] * 4 + [constrained] * 4, use_tqdm=False)
        assert texts(outputs[:4]) == reference
        assert_schema_outputs(outputs[4:])
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.cache.num_free_blocks == 40 and llm.engine.strategy.grammars.num_tracked == 0


def test_aborts_release_matchers_and_blocks(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=64, structured_output=StructuredOutputParams(json=SCHEMA))
    ids = [engine.add_request(p, params) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    assert engine.strategy.grammars.num_tracked == len(PROMPTS)
    engine.abort_request(ids)
    assert engine.strategy.grammars.num_tracked == 0 and not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


def test_invalid_grammar_is_refused_and_the_engine_keeps_serving(llm):
    bad = SamplingParams(structured_output=StructuredOutputParams(json={"type": "nope"}))
    with pytest.raises(InvalidRequestError, match="structured_output: invalid JSON schema"):
        llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=4), bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_speculative_decoding_and_beam_search_are_refused():
    spec = StructuredOutputParams(regex="[0-9]+")
    ngram = LLM("tiny", decoding="ngram")
    with pytest.raises(InvalidRequestError, match="speculative decoding .num_lookahead_tokens="):
        ngram.generate(PROMPTS[:1], SamplingParams(structured_output=spec), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="beam search"):
        SamplingParams(use_beam_search=True, temperature=0, structured_output=spec)
