"""Multi-step decoding (``decoding.multi_step``): the same tokens as one step at a time (and
as transformers), fewer scheduled steps, stops inside a run of steps, no leaked blocks,
clear start-up errors; and one step at a time, greedy tokens chosen in the native call."""

from __future__ import annotations

import pytest

from servelab import ConfigError, LLM, SamplingParams
from servelab.kernels.cpu_ops import native_cpu_available
from servelab.testing import assert_engine_matches_transformers, assert_no_leaked_blocks, mixed_prompts

BASE = ["model.dtype=float32", "device=cpu", "cache.block_size=4"]


def generate(llm: LLM, prompts, params) -> list[tuple[list[int], str]]:
    """Each request's tokens and finish reason."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


@pytest.mark.parametrize("scheduler", ["continuous", "chunked"])
@pytest.mark.parametrize("steps", [2, 5])
def test_greedy_matches_transformers_with_fewer_steps(llama, scheduler, steps):
    llm = LLM(llama, overrides=[*BASE, f"scheduler={scheduler}", f"decoding.multi_step={steps}"])
    assert_engine_matches_transformers(llama, llm=llm, max_tokens=14)
    before = llm.engine.num_steps
    generate(llm, [[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True))
    # one prefill step, then 20 tokens at up to `steps` a scheduled step
    assert llm.engine.num_steps - before == 1 + -(-20 // steps)


def test_every_kind_of_request_gives_the_tokens_of_single_steps(llama):
    """Seeded sampling, logprobs, penalties and min_tokens (run a step at a time), stop
    tokens and max_model_len reached inside a run of steps: what one step at a time gives."""
    prompts = mixed_prompts(200, lengths=(3, 17, 9, 30, 5, 12))
    single = LLM(llama, overrides=[*BASE, "model.max_model_len=48"])
    stop_token = generate(single, [prompts[5]], SamplingParams(temperature=0.0, max_tokens=12))[0][0][6]
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=13, ignore_eos=True),
              SamplingParams(temperature=0.0, logprobs=2, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),  # stops at max_model_len
              SamplingParams(temperature=0.0, min_tokens=4, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.0, stop_token_ids=[stop_token], max_tokens=12)]
    expected = generate(single, prompts, params)
    assert expected[3][1] == "length" and len(expected[3][0]) == 48 - 30
    assert expected[5][1] == "stop" and len(expected[5][0]) <= 7
    for strategy in ("sampling", "greedy"):
        llm = LLM(llama, overrides=[*BASE, "model.max_model_len=48", f"decoding={strategy}", "decoding.multi_step=4"])
        together = generate(llm, prompts, params)  # the penalty keeps the batch to single steps at first
        alone = [generate(llm, [prompt], one)[0] for prompt, one in zip(prompts, params)]
        if strategy == "sampling":
            assert together == alone == expected
        else:  # greedy takes the argmax whatever the temperature and penalties
            assert [alone[i] for i in (1, 3, 4, 5)] == [together[i] for i in (1, 3, 4, 5)] == [
                expected[i] for i in (1, 3, 4, 5)]
        logprobs = llm.generate([prompts[1]], params[1], use_tqdm=False)[0].outputs[0].logprobs
        assert len(logprobs) == 11 and all(len(entry) >= 2 for entry in logprobs)
        assert_no_leaked_blocks(llm)


@pytest.mark.skipif(not native_cpu_available(), reason="needs the native CPU ops")
def test_greedy_steps_run_in_one_native_call(llama):
    """A plainly greedy batch runs its steps in the native stack's one call, and its
    tokens are those of the Python steps."""
    llm = LLM(llama, overrides=[*BASE, "decoding.multi_step=6"])
    worker = llm.engine.executor.worker
    calls = []
    original = worker.greedy_steps
    worker.greedy_steps = lambda inputs, steps: calls.append(steps) or original(inputs, steps)
    prompts = mixed_prompts(200, lengths=(4, 19, 7))
    got = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True))
    assert calls and max(calls) == 6
    expected = generate(LLM(llama, overrides=BASE), prompts, SamplingParams(temperature=0.0, max_tokens=15,
                                                                           ignore_eos=True))
    assert got == expected
    assert_no_leaked_blocks(llm)


@pytest.mark.skipif(not native_cpu_available(), reason="needs the native CPU ops")
def test_a_greedy_step_at_a_time_chooses_its_token_in_the_native_call(llama):
    """One step at a time, a plainly greedy decode step takes its argmax inside the model's
    native call (no logits handed to the sampler) and gives transformers' tokens; a batch
    with a request that asks for logprobs goes through the sampler, with the same tokens."""
    llm = LLM(llama, overrides=BASE)
    model, strategy = llm.engine.executor.worker.model, llm.engine.executor.strategy
    native, sampled = [], []
    greedy_steps, accept = model.greedy_steps, strategy.accept
    model.greedy_steps = lambda *args: native.append(args[-1]) or greedy_steps(*args)
    strategy.accept = lambda logits, batch, proposal: sampled.append(len(batch.requests)) or accept(logits, batch,
                                                                                                      proposal)
    assert_engine_matches_transformers(llama, llm=llm, max_tokens=9)
    assert native and set(native) == {1}
    assert len(sampled) == llm.engine.num_steps - len(native)  # prefill steps only
    prompts = mixed_prompts(201, lengths=(5, 11))
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = generate(llm, prompts, plain)
    native.clear()
    with_logprobs = llm.generate(prompts, [plain, SamplingParams(temperature=0.0, logprobs=1, max_tokens=8,
                                                                 ignore_eos=True)], use_tqdm=False)
    assert not native
    assert [o.outputs[0].token_ids for o in with_logprobs] == [tokens for tokens, _ in alone]
    assert len(with_logprobs[1].outputs[0].logprobs) == 8
    assert_no_leaked_blocks(llm)


def test_bad_multi_step_is_refused_naming_the_field(llama):
    with pytest.raises(ConfigError, match=r"decoding\.multi_step must be at least 1"):
        LLM(llama, overrides=[*BASE, "decoding.multi_step=0"])
    with pytest.raises(ConfigError, match=r"decoding\.multi_step=3: executor SimulatedExecutor"):
        LLM(llama, overrides=[*BASE, "executor=simulated", "decoding.multi_step=3"])
    with pytest.raises(ConfigError, match=r"decoding\.multi_step=2: multi-step decoding runs on one pipeline stage"):
        LLM(llama, overrides=[*BASE, "decoding.multi_step=2", "lora.enabled=true"])
