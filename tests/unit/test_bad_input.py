"""Bad requests get errors naming the field and the limit; the engine keeps serving."""

from __future__ import annotations

import pytest

from servelab import InvalidRequestError, LLM, SamplingParams


@pytest.fixture(scope="module")
def toy() -> LLM:
    """A small-context random model."""
    return LLM("toy", overrides=["device=cpu", "model.max_model_len=64"])


@pytest.mark.parametrize("kwargs,field,phrase", [
    (dict(max_tokens=0), "max_tokens", ">= 1"),
    (dict(temperature=-0.5), "temperature", ">= 0"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(top_k=-3), "top_k", "-1 or 0"),
    (dict(min_p=2.0), "min_p", "[0, 1]"),
    (dict(n=0), "n", ">= 1"),
    (dict(presence_penalty=5.0), "presence_penalty", "[-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty", "> 0"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens", "<= max_tokens"),
    (dict(logprobs=50), "logprobs", "[0, 20]"),
    (dict(logit_bias={"5": 1.0}), "logit_bias", "keys must be token ids"),
    (dict(logit_bias={5: float("nan")}), "logit_bias", "values must be numbers"),
    (dict(logit_bias=[5]), "logit_bias", "must map token ids"),
])
def test_bad_sampling_params_name_the_field(kwargs, field, phrase):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert field in str(info.value) and phrase in str(info.value)


@pytest.mark.parametrize("prompt,field,phrase", [
    ("", "prompt", "must not be empty"),
    ([], "prompt", "must not be empty"),
    ([1, 2, 100000], "prompt_token_ids", "outside the vocabulary [0, 257)"),
    ([-1], "prompt_token_ids", "outside the vocabulary"),
    ([5] * 64, "prompt", "maximum context length is 64 tokens"),
])
def test_bad_prompts_are_rejected_before_the_engine(toy, prompt, field, phrase):
    engine = toy.engine
    good = engine.add_request("a good request", SamplingParams(temperature=0.0, max_tokens=6))
    engine.step()
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(prompt, SamplingParams(max_tokens=4))
    assert info.value.field == field and phrase in str(info.value)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [good]
    assert len(finished[0].outputs[0].token_ids) == 6
    assert engine.cache.usage.used_blocks == 0


def test_generate_validates_every_prompt_first(toy):
    with pytest.raises(InvalidRequestError):
        toy.generate(["fine", [5] * 100], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not toy.engine.has_unfinished_requests()


def test_generation_stops_at_max_model_len(toy):
    out = toy.generate([[3] * 60], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_abort_frees_blocks(toy):
    engine = toy.engine
    ids = [engine.add_request("abort me please", SamplingParams(max_tokens=40, ignore_eos=True)) for _ in range(3)]
    engine.step()
    engine.step()
    assert engine.cache.usage.used_blocks > 0
    engine.abort_request(ids)
    assert not engine.has_unfinished_requests()
    assert engine.cache.usage.used_blocks == 0


def test_more_sequences_than_the_scheduler_runs_are_refused():
    llm = LLM("toy", overrides=["scheduler.max_num_seqs=2"])
    with pytest.raises(InvalidRequestError, match=r"n: 3 sequences .* scheduler.max_num_seqs=2"):
        llm.generate(["hello"], SamplingParams(n=3, max_tokens=2), use_tqdm=False)
    assert len(llm.generate(["hello"], SamplingParams(n=2, max_tokens=2), use_tqdm=False)[0].outputs) == 2
