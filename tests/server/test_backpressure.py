"""Backpressure against a real server: past ``server.max_queued_requests`` calls get 429
with ``Retry-After`` while the accepted ones complete, ``/health`` stays quick, a call
past ``server.request_timeout_s`` is aborted with 504 or an error event, and no KV block
is left held; bad values are refused at start-up naming the field."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import MODEL, ServerProcess

from servelab.server.config import compose_serve_config, server_problems

LIMIT = 6
TIMEOUT_S = 3
ENGINE = ("model=toy", "cache.num_blocks=1024", "model.shape.max_position_embeddings=4096")
"""The toy model with room for requests that outlast ``TIMEOUT_S`` (positions past 512
do not change its first 512, so greedy results equal the shared offline engine's)."""


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A server holding at most ``LIMIT`` requests, each for at most ``TIMEOUT_S``."""
    proc = ServerProcess(tmp_path_factory.mktemp("backpressure") / "server.log", f"server.max_queued_requests={LIMIT}",
                         f"server.request_timeout_s={TIMEOUT_S}", engine=ENGINE)
    yield proc
    assert proc.stop() == 0, proc.log()


def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics`` by (name, sorted labels)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_idle(server) -> dict[tuple[str, tuple], float]:
    """The metrics once nothing runs, waits or holds KV cache (or after 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        samples = scrape(server)
        held = [samples[(f"servelab:{name}", ())] for name in ("num_requests_running", "num_requests_waiting",
                                                               "kv_cache_usage_perc")]
        if held == [0, 0, 0] or time.monotonic() > deadline:
            assert held == [0, 0, 0]
            return samples
        time.sleep(0.1)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    """How much the counter ``name`` grew."""
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict:
    """The error of ``response``, which has ``status`` and OpenAI's error shape."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


async def _call(client: httpx.AsyncClient, path: str, body: dict) -> tuple[int, dict, str | None]:
    """Status, JSON body (a stream's chunks merged into the text) and Retry-After."""
    if not body.get("stream"):
        response = await client.post(path, json=body)
        return response.status_code, response.json(), response.headers.get("retry-after")
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, response.json(), response.headers.get("retry-after")
        chunks = [json.loads(line[6:]) async for line in response.aiter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    return 200, {"choices": [{"text": "".join(c["choices"][0]["text"] for c in chunks if c["choices"])}]}, None


async def _probe(client: httpx.AsyncClient, done: asyncio.Event) -> list[tuple[float, int, float]]:
    """``/health`` and ``/metrics`` until ``done``: (latency, status, when answered) each."""
    probes = []
    while not done.is_set():
        for path in ("/health", "/metrics"):
            started = time.monotonic()
            status = (await client.get(path)).status_code
            probes.append((time.monotonic() - started, status, time.monotonic()))
        await asyncio.sleep(0.02)
    return probes


def test_flood_past_the_limit_gets_429_and_accepted_calls_complete(limited, greedy):
    prompts = [f"flood {i}: " for i in range(30)]
    bodies = [("/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 32, "temperature": 0,
                                   "stream": i % 2 == 1}) for i, p in enumerate(prompts)]
    bodies += [("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                                         "max_tokens": 32}) for i in range(6)]
    before = scrape(limited)

    async def flood() -> tuple[list, list, float]:
        async with httpx.AsyncClient(base_url=limited.url, timeout=60) as client, \
                httpx.AsyncClient(base_url=limited.url, timeout=60) as prober:
            done = asyncio.Event()
            probing = asyncio.create_task(_probe(prober, done))
            results = await asyncio.gather(*(_call(client, path, body) for path, body in bodies))
            last_answer = time.monotonic()
            done.set()
            return results, await probing, last_answer

    results, probes, last_answer = asyncio.run(asyncio.wait_for(flood(), timeout=120))
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses, statuses
    completed = {}
    for (status, body, retry_after), (path, request) in zip(results, bodies):
        if status == 429:
            assert int(retry_after) >= 1
            error = body["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "rate_limit_exceeded"
            assert f"server.max_queued_requests={LIMIT}" in error["message"]
        elif path == "/v1/completions":
            completed[request["prompt"]] = body["choices"][0]["text"]
        else:
            assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert completed and list(completed.values()) == [text for text, _, _ in greedy(list(completed), 32)]
    assert probes and all(status == 200 for _, status, _ in probes)
    assert max(latency for latency, _, _ in probes) < 2.0, probes
    assert min(answered for _, _, answered in probes) < last_answer  # answered during the flood
    after = wait_idle(limited)
    assert delta(before, after, "servelab:num_requests_rejected_total") == statuses.count(429)


def test_more_prompts_than_the_limit_is_400(limited):
    response = httpx.post(f"{limited.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": ["p"] * (LIMIT + 1), "max_tokens": 2})
    error = assert_openai_error(response, 400, "invalid_value")
    assert error["param"] == "prompt" and f"server.max_queued_requests={LIMIT}" in error["message"]


def test_timed_out_calls_are_aborted_and_others_complete(limited, greedy):
    long = {"model": MODEL, "prompt": "long", "max_tokens": 4000, "ignore_eos": True}
    shorts = [f"short {i}" for i in range(3)]
    expected = greedy(shorts, 8)
    before = scrape(limited)

    async def run() -> tuple[httpx.Response, list[str], list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=limited.url, timeout=60) as client:
            started = time.monotonic()
            whole = asyncio.create_task(client.post("/v1/completions", json=long))
            async with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
                assert response.status_code == 200
                events = []
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 1:  # the long calls run: the short ones must still be served
                        answers = await asyncio.gather(*(client.post("/v1/completions", json={
                            "model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0}) for p in shorts))
            return await whole, events, answers, time.monotonic() - started

    whole, events, answers, elapsed = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert [(a.status_code, a.json()["choices"][0]["text"]) for a in answers] == [(200, e[0]) for e in expected]
    error = assert_openai_error(whole, 504, "request_timeout")
    assert f"server.request_timeout_s={TIMEOUT_S}" in error["message"]
    *chunks, last, done = events
    assert done == "[DONE]" and json.loads(last)["error"]["code"] == "request_timeout"
    assert chunks and all(json.loads(c)["choices"][0]["finish_reason"] is None for c in chunks)
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 30
    after = wait_idle(limited)
    assert delta(before, after, "servelab:num_requests_timed_out_total") == 2
    assert delta(before, after, "servelab:request_success_total", finished_reason="abort",
                 tenant="default") == 2
    assert "Traceback" not in limited.log()


def test_openapi_documents_429_and_504(limited):
    paths = httpx.get(f"{limited.url}/openapi.json", timeout=30).json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert {"429", "504"} <= set(responses)
        assert "Retry-After" in responses["429"]["headers"]


@pytest.mark.parametrize("override, message", [
    ("server.max_queued_requests=0", "server.max_queued_requests must be at least 1 (or null for no limit), got 0"),
    ("server.max_queued_requests=-5", "server.max_queued_requests must be at least 1"),
    ("server.request_timeout_s=0", ("server.request_timeout_s must be more than 0 seconds (or null for no limit), "
                                    "got 0.0")),
    ("server.request_timeout_s=-1.5", "server.request_timeout_s must be more than 0 seconds"),
])
def test_bad_backpressure_settings_name_the_field(override, message):
    problems = server_problems(compose_serve_config(["model=toy", override]).server)
    assert len(problems) == 1 and message in problems[0]


def test_defaults_and_null_are_accepted():
    server = compose_serve_config(["model=toy"]).server
    assert (server.max_queued_requests, server.request_timeout_s) == (1024, None)
    unbounded = compose_serve_config(["model=toy", "server.max_queued_requests=null", "server.request_timeout_s=60"])
    assert server_problems(unbounded.server) == []


def test_serve_refuses_a_bad_limit_at_start_up():
    result = subprocess.run([sys.executable, "-m", "servelab.server", "model=toy", "server.max_queued_requests=-1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "server.max_queued_requests must be at least 1 (or null for no limit), got -1" in result.stderr
