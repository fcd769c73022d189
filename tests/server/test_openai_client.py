"""The official ``openai`` client against a real server: results equal offline greedy."""

from __future__ import annotations

import pytest

from servelab.checkpoints.toy import byte_level_tokenizer
from servelab.server.chat_template import fallback_chat_prompt
from servelab.server.protocol import ChatMessage
from server_process import MODEL

TOKENIZER = byte_level_tokenizer()
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\n"]


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_completion_equals_offline_greedy(client, greedy):
    expected = greedy(PROMPTS, 12)
    for prompt, (text, token_ids, finish) in zip(PROMPTS, expected):
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        choice = result.choices[0]
        assert (choice.text, choice.finish_reason) == (text, finish)
        assert result.usage.completion_tokens == len(token_ids)
        assert result.usage.prompt_tokens == len(encode(prompt))
        assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
        assert result.object == "text_completion" and result.model == MODEL


def test_streamed_completion_equals_offline_greedy_with_usage(client, greedy):
    (text, token_ids, finish), = greedy(PROMPTS[:1], 12)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts_batches_and_echo(client, greedy):
    ids = encode(PROMPTS[1])
    expected = greedy([ids, PROMPTS[2]], 8)
    for batch in ([ids, encode(PROMPTS[2])], [PROMPTS[1], PROMPTS[2]]):
        result = client.completions.create(model=MODEL, prompt=batch, max_tokens=8, temperature=0)
        assert [c.index for c in result.choices] == [0, 1]
        assert [c.text for c in result.choices] == [e[0] for e in expected]
    echoed = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[1] + expected[0][0]


def test_chat_equals_offline_greedy_on_fallback_template(client, greedy):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = fallback_chat_prompt([ChatMessage(**m) for m in messages])
    (text, token_ids, finish), = greedy([prompt], 10)
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert result.choices[0].message.role == "assistant"
    assert (result.choices[0].message.content, result.choices[0].finish_reason) == (text, finish)
    assert result.usage.completion_tokens == len(token_ids)
    assert result.usage.prompt_tokens == len(encode(prompt))

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].usage.total_tokens == result.usage.total_tokens


def test_n_choices_streamed_and_not(client, greedy):
    (text, _, _), = greedy(PROMPTS[:1], 6)
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, n=3)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert all(c.text == text for c in result.choices)
    assert result.usage.completion_tokens == 18

    sampled = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3,
                                             max_tokens=6, temperature=1.0, seed=7, stream=True)
    finishes: dict[int, list[str]] = {}
    roles: set[int] = set()
    for chunk in sampled:
        choice = chunk.choices[0]
        if choice.delta.role:
            roles.add(choice.index)
        if choice.finish_reason:
            finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert roles == {0, 1, 2}
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}


def test_logprobs_completion_and_chat(client):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert value == pytest.approx(max(top.values()))  # greedy takes the most likely token

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.bytes == list(item.token.encode("utf-8"))

    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    items = [i for c in streamed if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert [i.token for i in items] == [i.token for i in content]


def test_stop_strings_match_offline(client, greedy):
    (full, _, _), = greedy(PROMPTS[:1], 16, ignore_eos=True)
    stop = full[5:7]
    (text, _, finish), = greedy(PROMPTS[:1], 16, ignore_eos=True, stop=[stop])
    assert finish == "stop" and stop not in text
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                       stop=[stop], extra_body={"ignore_eos": True})
    assert (result.choices[0].text, result.choices[0].finish_reason) == (text, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_tokenize_detokenize_version(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    tokens = http.post("/tokenize", json={"prompt": "hello"}).json()
    assert tokens["count"] == 5 and tokens["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "hello"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len("<|user|>\nhi\n<|assistant|>\n")
    assert http.get("/version").json()["version"]


def test_logit_bias_forces_and_bans_tokens_on_both_endpoints(client, offline):
    from servelab import SamplingParams

    x = encode("x")[0]
    forced = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                       logit_bias={str(x): 100})
    assert forced.choices[0].text == "xxxx"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logit_bias={str(x): 100})
    assert chat.choices[0].message.content == "xxx"
    top = offline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1, logprobs=2),
                           use_tqdm=False)[0].outputs[0].logprobs[0]
    first, runner_up = sorted(top, key=lambda token: -top[token].logprob)[:2]
    banned = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text == TOKENIZER.decode([runner_up])   # the bias moves one token, nothing else


def test_best_of_returns_the_best_candidates_by_logprob_per_token(client):
    args = dict(model=MODEL, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=6, temperature=1.0, seed=3)
    every = client.completions.create(n=4, logprobs=0, **args)
    best = client.completions.create(n=2, best_of=4, **args)
    assert [c.index for c in best.choices] == [0, 1, 2, 3] and all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == every.usage.completion_tokens
    for prompt in range(2):
        candidates = every.choices[prompt * 4:prompt * 4 + 4]
        ranked = sorted(candidates, key=lambda c: -sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs))
        assert [c.text for c in best.choices[prompt * 2:prompt * 2 + 2]] == [c.text for c in ranked[:2]]


def test_echo_with_logprobs_scores_the_prompt_as_offline(client, offline):
    """What evaluation harnesses send: echo, logprobs, max_tokens 0 and 1, token-id prompts."""
    from servelab import SamplingParams

    ids = [encode(p) for p in PROMPTS]
    reference = offline.generate(ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    for max_tokens in (0, 1):
        result = client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0,
                                           logprobs=2, echo=True)
        for prompt, expected, choice in zip(PROMPTS, reference, result.choices):
            logprobs = choice.logprobs
            generated = expected.outputs[0].token_ids if max_tokens else []
            assert choice.text == prompt + (expected.outputs[0].text if max_tokens else "")
            assert len(logprobs.tokens) == len(expected.prompt_token_ids) + len(generated)
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
            assert "".join(logprobs.tokens) == choice.text
            assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
            for position, token in enumerate(expected.prompt_token_ids[1:], start=1):
                assert logprobs.token_logprobs[position] == pytest.approx(
                    expected.prompt_logprobs[position][token].logprob, abs=1e-5)
                assert 2 <= len(logprobs.top_logprobs[position]) <= 3
            assert choice.finish_reason == "length"
        assert result.usage.completion_tokens == (len(PROMPTS) if max_tokens else 0)

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0, logprobs=1, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPTS[0]
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == len(encode(PROMPTS[0]))


def test_prompt_logprobs_field_in_vllm_format(http, offline):
    from servelab import SamplingParams

    (expected,) = offline.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                                   use_tqdm=False)
    body = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 2,
                                              "temperature": 0, "prompt_logprobs": 1}).json()
    choice = body["choices"][0]
    assert choice["logprobs"] is None and choice["prompt_logprobs"][0] is None
    assert len(choice["prompt_logprobs"]) == len(expected.prompt_token_ids)
    for token, entry, reference in zip(expected.prompt_token_ids[1:], choice["prompt_logprobs"][1:],
                                       expected.prompt_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(reference[token].logprob, abs=1e-5)
        assert entry[str(token)]["rank"] == reference[token].rank and len(entry) <= 2
    bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "prompt_logprobs": 21})
    assert bad.status_code == 400 and "prompt_logprobs" in bad.text
