"""Many concurrent streams, and many requests cancelled mid-flight, against a real server."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
from server_process import API_KEY, MODEL


def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of ``/metrics`` by (name, sorted labels)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_64_concurrent_streams_equal_offline_greedy(server, greedy):
    prompts = [f"request {i}: " for i in range(64)]
    expected = greedy(prompts, 8)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, list[str]]:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        text, finishes = "", []
        async for chunk in stream:
            text += chunk.choices[0].text
            if chunk.choices[0].finish_reason:
                finishes.append(chunk.choices[0].finish_reason)
        return text, finishes

    async def run_all() -> list[tuple[str, list[str]]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [r[0] for r in results] == [e[0] for e in expected]
    assert [r[1] for r in results] == [[e[2]] for e in expected]


async def _cancelled_request(client: httpx.AsyncClient, i: int, rng: random.Random) -> None:
    """Send a long request and abandon it at a random moment: before the answer, after
    some chunks, or while waiting for a non-streamed answer."""
    stream = i % 4 != 0
    body = {"model": MODEL, "prompt": f"cancel me {i}", "max_tokens": 300, "ignore_eos": True, "stream": stream}
    chunks_to_read = rng.randint(0, 6)

    async def go() -> None:
        if not stream:
            await client.post("/v1/completions", json=body)
            return
        async with client.stream("POST", "/v1/completions", json=body) as response:
            read = 0
            async for line in response.aiter_lines():
                read += line.startswith("data: ")
                if read > chunks_to_read:
                    return

    try:
        await asyncio.wait_for(go(), timeout=rng.uniform(0.0, 0.5))
    except asyncio.TimeoutError:
        pass


def test_cancelled_requests_free_their_cache(server, http, greedy):
    before = scrape(server)

    async def run_all() -> None:
        rng = random.Random(0)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60, limits=limits) as client:
            for start in range(0, 200, 40):
                await asyncio.gather(*(_cancelled_request(client, i, rng) for i in range(start, start + 40)))

    asyncio.run(asyncio.wait_for(run_all(), timeout=300))
    deadline = time.monotonic() + 60
    while True:
        after = scrape(server)
        idle = [after[(name, ())] for name in ("servelab:num_requests_running", "servelab:num_requests_waiting",
                                               "servelab:kv_cache_usage_perc")]
        if idle == [0, 0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle == [0, 0, 0]
    key = ("servelab:request_success_total", (("finished_reason", "abort"), ("tenant", "default")))
    assert 0 < after.get(key, 0) - before.get(key, 0) <= 200

    (text, _, finish), = greedy(["fresh"], 8)
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "fresh", "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200
    assert (response.json()["choices"][0]["text"], response.json()["choices"][0]["finish_reason"]) == (text, finish)
    assert "Traceback" not in server.log()


def test_streamed_chunks_are_openai_sse(server, http):
    with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"]["role"] for c in chunks[:2]] == ["assistant", "assistant"]
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [(0, "length"), (1, "length")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_disconnected_non_streamed_request_is_aborted(server):
    def gauge(samples, name):
        return samples.get((f"servelab:{name}", ()), 0.0)

    abort_key = ("servelab:request_success_total", (("finished_reason", "abort"), ("tenant", "default")))
    before = scrape(server)

    async def run() -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120) as client:
            body = {"model": MODEL, "prompt": "x", "max_tokens": 480, "ignore_eos": True}
            task = asyncio.create_task(client.post("/v1/completions", json=body))
            while gauge(scrape(server), "num_requests_running") < 1:
                await asyncio.sleep(0.05)
            task.cancel()

    asyncio.run(asyncio.wait_for(run(), timeout=120))
    deadline = time.monotonic() + 30
    while gauge(after := scrape(server), "num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gauge(after, "num_requests_running") == 0 and gauge(after, "kv_cache_usage_perc") == 0
    assert after.get(abort_key, 0) - before.get(abort_key, 0) == 1
    tokens_key = ("servelab:generation_tokens_total", (("tenant", "default"),))
    generated = after[tokens_key] - before[tokens_key]
    assert generated < 480
