"""``server.backend=ray router=kv_aware`` on a local Ray cluster: two ``model=toy`` replicas
with prefix caching, routed by what each replica's prefix cache holds, load permitting.

Needs the ``ray`` extra (``pip install -e ".[test,ray]"``); skipped without it.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from ray_app import local_ray_app, openai_client
from server_process import ENGINE_OVERRIDES, MODEL

pytest.importorskip("ray.serve")

OVERRIDES = [*ENGINE_OVERRIDES, "cache.enable_prefix_caching=true", "server.replicas=2", "server.routing=router",
             "router=kv_aware", "server.warmup_tokens=0"]
PREFIX = "A long system prompt that every turn of this conversation shares with the others: " * 2
"""Several 16-token cache blocks of the byte-level tokenizer."""
STATS_WAIT_S = 3.0
"""Long enough for every replica to report its cache to the router (each second)."""


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


def per_replica(url: str, metric: str) -> dict[str, float]:
    """``metric``'s value per replica id, from the ingress's ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for labels, value in re.findall(rf"^{metric}\{{([^}}]*)\}} (\S+)$", text, re.M):
        replica = re.search(r'replica="([^"]+)"', labels).group(1)
        values[replica] = values.get(replica, 0.0) + float(value)
    return values


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """How much each replica's value went up."""
    return {r: after[r] - before.get(r, 0.0) for r in after if after[r] > before.get(r, 0.0)}


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = 2) -> None:
    """One greedy completion."""
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)


SUCCESSES = "servelab:request_success_total"
HITS = "servelab:prefix_cache_hit_tokens_total"


def test_a_shared_prefix_goes_where_it_is_cached(url, client):
    # A long request keeps the first replica busy: the prefix's first turn goes to the other.
    busy = client.completions.create(model=MODEL, prompt="keep me busy", max_tokens=460, temperature=0,
                                     stream=True, extra_body={"ignore_eos": True})
    next(iter(busy))
    before = per_replica(url, SUCCESSES)
    complete(client, PREFIX + "first turn")
    [home] = grown(before, per_replica(url, SUCCESSES))
    for _ in busy:
        pass

    # Both replicas idle, and each has reported its cache since (replacing the blocks the
    # router expected): without those reports the tie would go to the first replica.
    time.sleep(STATS_WAIT_S)
    before_hits, before = per_replica(url, HITS), per_replica(url, SUCCESSES)
    complete(client, PREFIX + "second turn")
    assert list(grown(before, per_replica(url, SUCCESSES))) == [home]
    assert grown(before_hits, per_replica(url, HITS)).get(home, 0) >= 16 * (len(PREFIX) // 16)


def test_prompts_sent_together_with_a_new_prefix_share_a_replica(url, client):
    prefix = PREFIX.replace("system prompt", "tool manual")
    before = per_replica(url, SUCCESSES)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda turn: complete(client, prefix + turn, 32), ["one", "two"]))
    assert list(grown(before, per_replica(url, SUCCESSES)).values()) == [2]


def test_load_spreads_unrelated_prompts(url, client):
    before = per_replica(url, SUCCESSES)
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: complete(client, f"unrelated prompt {i}", 64), range(6)))
    assert len(grown(before, per_replica(url, SUCCESSES))) == 2


def test_kv_aware_names_what_it_needs_on_ray():
    from servelab.server.config import compose_serve_config
    from servelab.server.ray_serve.app import routing_problems

    assert routing_problems(compose_serve_config(OVERRIDES)) == []
    problems = routing_problems(compose_serve_config(["server.backend=ray", "router=kv_aware"]))
    assert [p.split(" (")[0] for p in problems] == [
        "router=kv_aware needs server.routing=router",
        "router=kv_aware routes by what the replicas' prefix caches hold: set cache.enable_prefix_caching=true"]
