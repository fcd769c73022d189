"""Bad requests get OpenAI-shaped errors with the right status; /metrics counts what was served."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import MODEL

OK = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("fields, param, phrase", [
    ({"temperature": -1}, "temperature", "must be >= 0"),
    ({"top_p": 1.5}, "top_p", "must be in (0, 1]"),
    ({"n": 0}, "n", "must be an integer >= 1"),
    ({"logprobs": 50}, "logprobs", "less than or equal to 20"),
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ({"max_tokens": "many"}, "max_tokens", "valid integer"),
    ({"frobnicate": 1}, "frobnicate", "Extra inputs are not permitted"),
    ({"prompt": [1, 2, 100000]}, "prompt_token_ids", "outside the vocabulary"),
    ({"prompt": "x" * 600}, "prompt", "This model's maximum context length is 512 tokens"),
    ({"prompt": "x" * 500, "max_tokens": 20}, "max_tokens", "This model's maximum context length is 512 tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids, got 'abc'"),
    ({"logit_bias": {"-3": 1}}, "logit_bias", "integers >= 0"),
    ({"logit_bias": {"100000": 1}}, "logit_bias", "outside the vocabulary"),
    ({"n": 3, "best_of": 2}, "best_of", "must be >= n (3)"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
])
def test_bad_completion_parameters_are_400(http, fields, param, phrase):
    error = error_of(http.post("/v1/completions", json={**OK, **fields}), 400)
    assert error["param"] == param and phrase in error["message"]
    assert error["type"] == "invalid_request_error"


def test_bad_chat_requests_and_bodies_are_400(http):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert error_of(http.post("/v1/chat/completions", json={**chat, "top_logprobs": 2}), 400)["param"] == "top_logprobs"
    assert error_of(http.post("/v1/chat/completions", json={**chat, "messages": []}), 400)["param"] == "messages"
    assert error_of(http.post("/v1/chat/completions", json={**chat, "tools": []}), 400)["param"] == "tools"
    bad_json = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    error_of(bad_json, 400)
    assert error_of(http.post("/detokenize", json={"tokens": [-1]}), 400)["param"] == "tokens"


def test_openai_client_sees_status_errors(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x" * 600, max_tokens=4)
    assert "This model's maximum context length is 512 tokens" in caught.value.message
    assert caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=4).choices[0].finish_reason


def test_api_key_model_and_route_errors(server, http):
    assert error_of(httpx.post(f"{server.url}/v1/completions", json=OK), 401)["code"] == "invalid_api_key"
    wrong = httpx.post(f"{server.url}/v1/completions", json=OK, headers={"Authorization": "Bearer nope"})
    error_of(wrong, 401)
    error_of(httpx.get(f"{server.url}/v1/models"), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    error = error_of(http.post("/v1/chat/completions", json={"model": "other", "messages": []}), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    error_of(http.get("/v1/nothing-here"), 404)


def _samples(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("servelab:")
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def test_metrics_count_what_was_served(server, http):
    before = _samples(server)
    for prompt in ("one", "two!", "three"):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        assert http.post("/v1/completions", json=body).status_code == 200
    after = _samples(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("servelab:request_success_total{finished_reason=length,tenant=default}") == 3
    assert delta("servelab:prompt_tokens_total{tenant=default}") == len("one") + len("two!") + len("three")
    assert delta("servelab:generation_tokens_total{tenant=default}") == 12
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"servelab:{histogram}_count{{tenant=default}}") == 3
    assert delta("servelab:inter_token_latency_seconds_count{tenant=default}") == 9
    assert delta("servelab:time_to_first_token_seconds_sum{tenant=default}") > 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total"):
        assert f"servelab:{name}" in after
