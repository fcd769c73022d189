"""Scheduling fields over HTTP: ``priority``, ``user`` / ``X-Servelab-Tenant``, ``deadline``
and ``slo_class`` reach the engine, bad ones are 400 naming the field, a request the
deadline policy refuses is 503, and the ``tenant`` label of /metrics stays bounded."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import API_KEY, MODEL, ServerProcess

COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ENDPOINTS = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]


@pytest.fixture(scope="module")
def deadline_server(tmp_path_factory):
    """A server whose deadline policy refuses every request due within 10 s of now (the
    ``tight`` class always is, ``loose`` never), with one tenant label of its own and
    prefix caching."""
    proc = ServerProcess(tmp_path_factory.mktemp("deadline") / "server.log", "policy=deadline", "policy.slack=10",
                         "+slo_classes.tight={ttft:0.000001,tpot:1}", "+slo_classes.loose={ttft:1000,tpot:1000}",
                         "server.max_tenant_labels=1", "cache.enable_prefix_caching=true")
    yield proc
    proc.stop()


@pytest.fixture
def deadline_http(deadline_server):
    """A plain HTTP client of ``deadline_server``."""
    with httpx.Client(base_url=deadline_server.url, timeout=120) as c:
        yield c


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("path, body", ENDPOINTS)
@pytest.mark.parametrize("fields, headers, param, phrase", [
    ({"priority": 1001}, {}, "priority", "[-1000, 1000]"),
    ({"priority": 1.5}, {}, "priority", "valid integer"),
    ({"priority": True}, {}, "priority", "valid integer"),
    ({"user": ""}, {}, "user", "1 to 128 characters"),
    ({"user": "x" * 129}, {}, "user", "1 to 128 characters"),
    ({}, {"X-Servelab-Tenant": "tab\there"}, "X-Servelab-Tenant", "printable"),
    ({"deadline": "soon"}, {}, "deadline", "valid number"),
    ({"deadline": 1.0}, {}, "deadline", "in the past"),
    ({"slo_class": "gold"}, {}, "slo_class", "unknown SLO class 'gold'"),
    ({"slo_class": ""}, {}, "slo_class", "name of an SLO class"),
    ({"cache_salt": ""}, {}, "cache_salt", "1 to 256 characters"),
])
def test_bad_scheduling_fields_are_400_naming_the_field(http, path, body, fields, headers, param, phrase):
    error = error_of(http.post(path, json={**body, **fields}, headers=headers), 400)
    assert error["param"] == param and phrase in error["message"], error
    assert http.post(path, json=body).status_code == 200  # the server keeps serving


def test_body_user_wins_over_the_tenant_header(http):
    good_user = {**COMPLETION, "user": "acme"}
    assert http.post("/v1/completions", json=good_user, headers={"X-Servelab-Tenant": "tab\there"}).status_code == 200


def _samples(server) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            if "le" not in s.labels:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def test_tenant_labels_are_bounded_and_slo_attainment_counted(deadline_server, deadline_http):
    before = _samples(deadline_server)
    requests = [({"user": "first"}, {}), ({}, {"X-Servelab-Tenant": "second"}), ({"user": "third"}, {}), ({}, {})]
    for fields, headers in requests:
        body = {**COMPLETION, "ignore_eos": True, "slo_class": "loose", "priority": 5, **fields}
        assert deadline_http.post("/v1/completions", json=body, headers=headers).status_code == 200
    after = _samples(deadline_server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    for tenant, count in (("first", 1), ("other", 2), ("default", 1)):
        assert delta(f"servelab:request_success_total{{finished_reason=length,tenant={tenant}}}") == count
        assert delta(f"servelab:generation_tokens_total{{tenant={tenant}}}") == 2 * count
        assert delta(f"servelab:prompt_tokens_total{{tenant={tenant}}}") == len("hello") * count
        assert delta(f"servelab:e2e_request_latency_seconds_count{{tenant={tenant}}}") == count
        assert delta(f"servelab:slo_requests_total{{outcome=attained,slo_class=loose,tenant={tenant}}}") == count
    assert not any("tenant=second" in name or "tenant=third" in name for name in after)


def test_prefixes_are_reused_under_the_same_cache_salt_only(deadline_server, deadline_http):
    prompt = "a shared preamble that spans several blocks of the byte-level tokenizer. " * 2

    def hits(salt: str) -> float:
        before = _samples(deadline_server).get("servelab:prefix_cache_hit_tokens_total", 0.0)
        body = {**COMPLETION, "prompt": prompt, "cache_salt": salt}
        assert deadline_http.post("/v1/completions", json=body).status_code == 200
        return _samples(deadline_server).get("servelab:prefix_cache_hit_tokens_total", 0.0) - before

    assert hits("tenant-a") == 0
    assert hits("tenant-a") >= 128
    assert hits("tenant-b") == 0


@pytest.mark.parametrize("path, body", ENDPOINTS)
def test_request_refused_by_the_deadline_policy_is_503(deadline_server, deadline_http, path, body):
    before = _samples(deadline_server)
    error = error_of(deadline_http.post(path, json={**body, "slo_class": "tight"}), 503)
    assert error["param"] == "deadline" and error["code"] == "deadline_exceeded"
    assert "could not serve this request before its deadline" in error["message"]
    soon = {**body, "deadline": time.time() + 5}  # in the future, but within the policy's slack
    assert error_of(deadline_http.post(path, json=soon), 503)["code"] == "deadline_exceeded"
    assert deadline_http.post(path, json={**body, "deadline": time.time() + 3600}).status_code == 200
    assert deadline_http.post(path, json={**body, "deadline": int(time.time()) + 3600}).status_code == 200
    after = _samples(deadline_server)
    refused = "servelab:request_success_total{finished_reason=deadline,tenant=default}"
    assert after[refused] - before.get(refused, 0.0) == 2
    missed = "servelab:slo_requests_total{outcome=missed,slo_class=tight,tenant=default}"
    assert after[missed] - before.get(missed, 0.0) == 1


@pytest.mark.parametrize("path, body", ENDPOINTS)
def test_streamed_refusal_ends_with_an_error_event(deadline_http, path, body):
    with deadline_http.stream("POST", path, json={**body, "slo_class": "tight", "stream": True}) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "deadline_exceeded" and error["param"] == "deadline"
    assert not any("choices" in event and json.loads(event)["choices"][0].get("finish_reason")
                   for event in events[:-2])


def test_openai_client_sends_user_and_extra_body(deadline_server):
    with openai.OpenAI(base_url=f"{deadline_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        before = _samples(deadline_server)
        result = client.completions.create(model=MODEL, prompt="hello", max_tokens=2, user="first",
                                           extra_body={"priority": 1, "slo_class": "loose", "ignore_eos": True})
        assert result.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2, user="first",
                                              extra_body={"priority": -1, "ignore_eos": True})
        assert chat.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="hello", max_tokens=2, extra_body={"priority": 5000})
        assert caught.value.body["param"] == "priority"
        with pytest.raises(openai.InternalServerError) as refused:
            client.completions.create(model=MODEL, prompt="hello", max_tokens=2, extra_body={"slo_class": "tight"})
        assert refused.value.status_code == 503 and refused.value.body["code"] == "deadline_exceeded"
    after = _samples(deadline_server)
    name = "servelab:request_success_total{finished_reason=length,tenant=first}"
    assert after[name] - before.get(name, 0.0) == 2
