"""cache=contiguous reservation policies (max / pow2 / oracle): how much a request reserves
at admission, that it keeps it, and that engines leak no blocks with any policy."""

from __future__ import annotations

import pytest

from servelab import LLM, ConfigError, SamplingParams
from servelab.core.entrypoints.compose import compose_config
from servelab.core.kv_cache import CacheContext
from servelab.core.engine.registry import get_registry
from servelab.core.request import Request
from servelab.plugins.cache.contiguous import next_power_of_two
from servelab.testing.cache_kit import SPEC, assert_empty


def cache_for(*overrides: str):
    """A contiguous cache over the kit's 32-token model (8 reservations of 32 tokens)."""
    cfg = compose_config(["cache=contiguous", "cache.num_slots=8", *overrides])
    return get_registry().build("cache", cfg.cache, CacheContext(SPEC, get_registry()))


def request(name: str, prompt: int, max_tokens: int | None) -> Request:
    return Request(name, list(range(prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None)


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 4, 5, 25, 32, 33)] == [1, 1, 2, 4, 4, 8, 32, 32, 64]


@pytest.mark.parametrize("policy, block_size, prompt, output, reserved", [
    ("max", None, 5, 3, 32),            # one max_model_len region
    ("oracle", 1, 5, 3, 8),             # exactly prompt + output
    ("oracle", None, 5, 3, 16),         # a whole 16-token block
    ("pow2", 1, 6, 5, 14),              # 6 + 8
    ("pow2", 1, 10, 20, 32),            # 10 + 32 capped at max_model_len
    ("oracle", 1, 4, None, 32),         # no max_tokens: up to max_model_len
])
def test_admission_reserves_the_policy_amount(policy, block_size, prompt, output, reserved):
    sizing = [] if block_size is None else [f"cache.block_size={block_size}"]
    cache = cache_for(f"cache.reservation={policy}", *sizing)
    r = request("r", prompt, output)
    assert cache.allocate(r, prompt) is not None
    r.num_computed_tokens = prompt
    usage = cache.usage
    assert usage.reserved_slots == reserved and usage.used_slots == prompt
    assert cache.usage.total_slots == 8 * 32
    for _ in range(min(output or 0, 32 - prompt) - 1):      # decoding stays inside the region
        assert cache.allocate(r, 1) is not None
        r.num_computed_tokens += 1
        assert cache.usage.reserved_slots == reserved
    cache.truncate(r, prompt)                                 # rolled-back drafts keep the region
    assert cache.usage.reserved_slots == reserved and cache.usage.used_slots == prompt
    cache.free(r)
    cache.free(r)
    assert_empty(cache)


def test_a_reservation_that_does_not_fit_is_refused_whole():
    cache = cache_for("cache.reservation=oracle", "cache.block_size=1")
    first = request("a", 30, 200)                             # reserves max_model_len = 32
    held = []
    for i in range(8):                                        # 8 x (30 + 2) fill the 256 slots
        r = request(f"r{i}", 30, 2)
        assert cache.allocate(r, 30) is not None
        held.append(r)
    before = cache.usage
    assert cache.allocate(first, 30) is None and cache.usage == before
    cache.free(held[0])
    assert cache.allocate(first, 30) is not None


def test_unknown_policy_names_the_field():
    with pytest.raises(ConfigError, match="cache.reservation must be one of max, pow2, oracle, got 'half'"):
        cache_for("cache.reservation=half")


@pytest.mark.parametrize("executor", [[], ["executor=simulated", "cost_model=roofline", "hardware=a100-80gb"]])
@pytest.mark.parametrize("policy", ["max", "pow2", "oracle"])
def test_engines_leak_no_blocks_and_match_the_paged_cache(executor, policy):
    """Greedy outputs equal the paged cache's with room for few reservations; nothing held at the end."""
    prompts = [[(7 * i + j) % 200 + 3 for j in range(8 + 5 * i)] for i in range(10)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(10)]
    base = ["model.max_model_len=128", "model.dtype=float32", "device=cpu", *executor]
    paged = LLM("toy", overrides=base).generate(prompts, params, use_tqdm=False)
    llm = LLM("toy", overrides=[*base, "cache=contiguous", f"cache.reservation={policy}", "cache.num_slots=3"])
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    if not executor:
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in paged]
    assert_empty(llm.engine.cache)
