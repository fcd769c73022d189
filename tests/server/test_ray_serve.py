"""``server.backend=ray`` on a local Ray cluster: two ``model=toy`` replicas behind Ray
Serve's HTTP proxy, routed by ``router=prefix_affinity``, driven by the openai client.

Needs the ``ray`` extra (``pip install -e ".[test,ray]"``); skipped without it.
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest
from ray_app import local_ray_app, openai_client
from server_process import ENGINE_OVERRIDES, MODEL

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

OVERRIDES = [*ENGINE_OVERRIDES, "server.replicas=2", "server.routing=router", "router=prefix_affinity",
             "server.warmup_tokens=0"]
REPLACEMENT_TIMEOUT_S = 180
PREFIXES = [f"{i:02d}: a prompt prefix to share," for i in range(8)]
"""Prompt prefixes longer than one cache block (16 tokens of the byte-level tokenizer)."""


@pytest.fixture(scope="module")
def url():
    """The application on a local Ray cluster of two CPUs, shut down afterwards."""
    with local_ray_app(OVERRIDES, MODEL) as address:
        yield address


@pytest.fixture
def client(url):
    """The official OpenAI client pointed at the Ray Serve proxy."""
    with openai_client(url) as c:
        yield c


def successes(url: str) -> dict[str, float]:
    """Finished sequences per replica id, from the ingress's ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts: dict[str, float] = {}
    for labels, value in re.findall(r"^servelab:request_success_total\{([^}]*)\} (\S+)$", text, re.M):
        replica = re.search(r'replica="([^"]+)"', labels).group(1)
        counts[replica] = counts.get(replica, 0.0) + float(value)
    replicas = set(re.findall(r'^servelab:num_requests_running\{replica="([^"]+)"\}', text, re.M))
    return {replica: counts.get(replica, 0.0) for replica in replicas}


def served_by(url: str, client: openai.OpenAI, prompt: str) -> str:
    """Complete ``prompt`` and return the id of the replica whose count went up."""
    before = successes(url)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = successes(url)
    grew = [r for r in after if after[r] > before.get(r, 0.0)]
    assert len(grew) == 1, (before, after)
    return grew[0]


def test_completions_and_chat_streamed_and_not(client, greedy):
    prompt = "def fibonacci(n):"
    [(text, _, finish)] = greedy([prompt], 12)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (text, finish)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == text

    messages = [{"role": "user", "content": "Hi!"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chat.usage.completion_tokens == 8


def test_errors_keep_their_shape(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, top_p=1.5)
    assert raised.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=4)


def test_prefix_affinity_keeps_each_prefix_on_its_replica(url, client):
    home: dict[str, str] = {}
    for prefix in PREFIXES:
        home[prefix] = served_by(url, client, prefix + " first")
        if len(set(home.values())) == 2:
            break
    assert len(set(home.values())) == 2, f"every prefix went to one replica: {home}"
    for prefix, replica in home.items():
        for suffix in (" second", " third"):
            assert served_by(url, client, prefix + suffix) == replica


def test_a_killed_replica_is_replaced_while_the_other_serves(url, client):
    prefix = PREFIXES[0]
    victim = served_by(url, client, prefix + " warm")
    [survivor] = set(successes(url)) - {victim}
    stream = client.completions.create(model=MODEL, prompt=prefix + " long", max_tokens=460, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    ray.kill(ray.get_actor(f"SERVE_REPLICA::servelab#EngineReplica#{victim}", namespace="serve"), no_restart=True)
    with pytest.raises(openai.APIError, match="replica"):
        for _ in stream:
            pass

    for i in range(3):
        assert served_by(url, client, f"{prefix} after {i}") == survivor
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still there?"}],
                                          max_completion_tokens=4)
    assert chat.choices[0].finish_reason == "length"

    deadline = time.monotonic() + REPLACEMENT_TIMEOUT_S
    while len(replicas := set(successes(url)) - {victim}) < 2:
        assert time.monotonic() < deadline, f"no replacement after {REPLACEMENT_TIMEOUT_S}s: {replicas}"
        time.sleep(1)
    assert survivor in replicas
    assert served_by(url, client, PREFIXES[1] + " replaced") in replicas
