"""Conformance kit for KV cache managers: the ``KVCacheManager`` contract, checked directly
on a small cache with requests whose computation the kit plays out itself."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import pytest
import torch

from servelab.core.kv_cache import CacheContext, KVCacheSpec
from servelab.core.request import Request
from servelab.core.sampling_params import SamplingParams
from servelab.testing.kit import ConformanceKit

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, max_model_len=32)
"""A model whose token takes 32 bytes of cache and whose sequences hold at most 32 tokens."""

WINDOWED_SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, max_model_len=32,
                            layer_windows=(6, None))
"""Two layers, the first attending to the last 6 tokens only: two KV cache groups."""


def make_request(name: str, num_tokens: int = SPEC.max_model_len, first: int = 0) -> Request:
    """A request of ``num_tokens`` distinct token ids starting at ``first``; nothing computed."""
    return Request(name, list(range(first, first + num_tokens)), SamplingParams(), None)


def compute(cache: Any, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> Any:
    """Allocate like a scheduler and, when it succeeds, count the tokens as computed."""
    allocation = cache.allocate(request, num_new_tokens, num_lookahead_tokens)
    if allocation is not None:
        request.num_computed_tokens += num_new_tokens
    return allocation


def blocks_for(cache: Any, num_tokens: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // cache.block_size)


def snapshot(cache: Any, requests: list[Request]) -> tuple:
    """Everything observable of the cache's state for these requests."""
    return cache.usage, cache.num_free_blocks, tuple(tuple(cache.block_table(r)) for r in requests)


def assert_empty(cache: Any) -> None:
    """No live request holds a block and every block can be allocated."""
    usage = cache.usage
    assert usage.used_blocks == 0 and usage.reserved_slots == 0 and usage.used_slots == 0, usage
    assert cache.num_free_blocks == usage.total_blocks


def held_blocks(cache: Any, table: list[int]) -> list[int]:
    """The blocks of a table, the cache's placeholder entries left out."""
    return [block for block in table if block != cache.null_block]


class KVCacheConformance(ConformanceKit):
    """The ``KVCacheManager`` contract. ``sizing``: overrides giving a cache of a few
    dozen to a few hundred 32-byte token slots (the built-ins take ``memory_bytes``);
    ``prefix_overrides`` / ``swap_overrides`` turn on prefix caching and a host pool
    (their tests skip when the cache has no such option or does not support it)."""

    kind = "cache"
    sizing: ClassVar[tuple[str, ...]] = ("cache.memory_bytes=4096",)
    prefix_overrides: ClassVar[tuple[str, ...]] = ("cache.enable_prefix_caching=true",)
    swap_overrides: ClassVar[tuple[str, ...]] = ("cache.swap_space_bytes=4096",)

    def build(self, name: str, *extra: str, spec: KVCacheSpec = SPEC) -> Any:
        """The cache ``name`` over ``spec``, built by the registry like the engine does."""
        return self.factory(name, *extra, spec=spec)()

    def factory(self, name: str, *extra: str, spec: KVCacheSpec = SPEC) -> Callable[[], Any]:
        """A function building fresh caches ``name`` over ``spec`` (the config composed once)."""
        from hydra.errors import ConfigCompositionException

        from servelab.core.entrypoints.compose import compose_config
        from servelab.core.engine.registry import get_registry

        try:
            cfg = compose_config([*self.component_overrides(name), *self.sizing, *extra])
        except ConfigCompositionException as exc:
            pytest.skip(f"cache={name} has no option for {list(extra)}: {exc}")
        registry = get_registry()
        return lambda: registry.build("cache", cfg.cache, CacheContext(spec, registry))

    def test_full_cache_refuses_and_changes_nothing(self, component):
        cache = self.build(component)
        held = []
        for i in range(10_000):
            request = make_request(f"r{i}", 16)
            if compute(cache, request, 16) is None:
                break
            held.append(request)
        else:
            pytest.fail("the cache never ran out of room")
        assert held, "a 16-token request did not fit an empty cache"
        before = snapshot(cache, [*held, request])
        assert cache.allocate(request, 16) is None
        assert cache.allocate(request, 8, num_lookahead_tokens=8) is None
        assert snapshot(cache, [*held, request]) == before, "a refused allocate changed the cache"

    def test_shutdown_drops_every_block(self, component):
        cache = self.build(component)
        live = [make_request(f"r{i}", 12) for i in range(3)]
        for request in live:
            assert compute(cache, request, 12) is not None
        cache.free(live.pop())
        cache.shutdown()
        assert_empty(cache)
        cache.shutdown()
        assert_empty(cache)

    def test_shutdown_drops_prefix_cached_blocks(self, component):
        cache = self.build(component, *self.prefix_overrides)
        if not cache.prefix_caching:
            pytest.skip(f"cache={component} has no prefix caching with {list(self.prefix_overrides)}")
        cached, live = make_request("cached", 24), make_request("live", 24, first=100)
        for request in (cached, live):
            assert compute(cache, request, 24) is not None
        cache.free(cached)
        assert cache.usage.cached_blocks > 0
        cache.shutdown()
        assert_empty(cache)
        assert cache.usage.cached_blocks == 0
        assert cache.lookup_prefix(make_request("again", 24)) == 0, "a shut-down cache still finds cached blocks"

    def test_free_is_idempotent(self, component):
        cache = self.build(component)
        requests = [make_request(f"r{i}", 12) for i in range(3)]
        for request in requests:
            assert compute(cache, request, 12) is not None
        for request in requests + requests:
            cache.free(request)
        assert_empty(cache)

    def test_truncate_releases_rolled_back_slots(self, component):
        cache = self.build(component)
        request = make_request("r", 32)
        assert compute(cache, request, 20, num_lookahead_tokens=4) is not None
        assert len(cache.block_table(request)) * cache.block_size >= 24
        cache.truncate(request, 21)
        table = cache.block_table(request)
        assert len(table) == blocks_for(cache, 21), f"{table} after truncating to 21 tokens"
        assert compute(cache, request, 1) is not None
        cache.free(request)
        assert_empty(cache)

    def test_fork_shares_blocks_and_copies_on_write(self, component):
        cache = self.build(component)
        if not cache.supports_fork:
            pytest.skip(f"cache={component} does not share blocks (supports_fork is False)")
        parent = make_request("parent", 32)
        assert compute(cache, parent, 10) is not None
        used = cache.usage.used_blocks
        child = make_request("child", 32)
        child.num_computed_tokens = 10
        cache.fork(parent, child)
        assert list(cache.block_table(child)) == list(cache.block_table(parent))[:blocks_for(cache, 10)]
        assert cache.usage.used_blocks == used, "a fork must share blocks, not copy them"
        parent_table = list(cache.block_table(parent))
        allocation = compute(cache, child, 1)
        assert allocation is not None
        if 10 % cache.block_size:
            (source, destination), = allocation.blocks_to_copy
            assert source == parent_table[10 // cache.block_size] == cache.block_table(parent)[-1]
            assert destination == cache.block_table(child)[-1] != source
        assert list(cache.block_table(parent)) == parent_table
        assert not compute(cache, parent, 1).blocks_to_copy, "the parent's block is its own again"
        cache.free(parent)
        cache.free(child)
        assert_empty(cache)

    def test_prefix_hits_reuse_full_blocks(self, component):
        cache = self.build(component, *self.prefix_overrides)
        if not cache.prefix_caching:
            pytest.skip(f"cache={component} has no prefix caching with {list(self.prefix_overrides)}")
        first = make_request("first", 30)
        assert cache.lookup_prefix(first) == 0
        assert compute(cache, first, 30) is not None
        table = list(cache.block_table(first))
        cache.free(first)
        second = make_request("second", 30)
        second.token_ids[24:] = [99] * 6
        hit = cache.lookup_prefix(second)
        assert hit == min(24, 29) // cache.block_size * cache.block_size
        assert list(cache.block_table(second)) == table[:hit // cache.block_size]
        second.num_computed_tokens = hit
        assert compute(cache, second, 30 - hit) is not None
        assert cache.prefix_hit_tokens >= hit
        cache.free(second)
        assert_empty(cache)

    def test_swap_round_trip(self, component):
        cache = self.build(component, *self.swap_overrides)
        if not cache.supports_swap:
            pytest.skip(f"cache={component} has no host pool with {list(self.swap_overrides)}")
        request = make_request("r", 32)
        assert compute(cache, request, 20) is not None
        table = list(cache.block_table(request))
        swapped = cache.swap_out(request)
        assert swapped is not None and [device for device, _ in swapped] == table
        assert cache.usage.used_blocks == 0 and cache.num_free_blocks == cache.num_blocks
        assert cache.can_swap_in(request)
        back = cache.swap_in(request)
        assert back is not None and [host for host, _ in back] == [host for _, host in swapped]
        assert list(cache.block_table(request)) == [device for _, device in back]
        assert compute(cache, request, 1) is not None
        cache.free(request)
        assert_empty(cache)

    def test_usage_counts_reserved_and_used_slots(self, component):
        cache = self.build(component)
        small, large = make_request("small", 32), make_request("large", 32, first=100)
        assert compute(cache, small, 5) is not None and compute(cache, large, 20) is not None
        usage = cache.usage
        tables = [cache.block_table(small), cache.block_table(large)]
        assert usage.used_blocks == len(set(tables[0]) | set(tables[1]))
        assert usage.reserved_slots == usage.used_blocks * cache.block_size
        assert usage.used_slots == 25
        assert usage.total_slots == cache.num_blocks * cache.block_size
        assert usage.waste == pytest.approx(1 - 25 / usage.reserved_slots)
        cache.free(small)
        cache.free(large)
        assert_empty(cache)

    def windowed(self, name: str, *extra: str) -> Any:
        """The cache over ``WINDOWED_SPEC``; skips when it keeps one group of every layer."""
        cache = self.build(name, *extra, spec=WINDOWED_SPEC)
        if len(cache.groups) < 2:
            pytest.skip(f"cache={name} keeps one KV cache group (every layer's every token)")
        assert cache.groups == WINDOWED_SPEC.groups
        return cache

    def test_windowed_groups_give_back_blocks_behind_the_window(self, component):
        cache = self.windowed(component)
        window = WINDOWED_SPEC.layer_windows[0]
        request = make_request("r", 32)
        assert compute(cache, request, 4) is not None
        for _ in range(27):
            assert compute(cache, request, 1) is not None
            windowed, full = cache.block_tables(request)
            assert len(full) == len(windowed) == blocks_for(cache, request.num_computed_tokens)
            first_read = max(0, request.num_computed_tokens - 1 - window + 1)
            assert held_blocks(cache, windowed) == windowed[first_read // cache.block_size:], \
                f"{windowed}: blocks before position {first_read} are still held, or later ones are not"
            assert len(held_blocks(cache, full)) == len(full)
        assert cache.usage.used_blocks < 2 * blocks_for(cache, request.num_computed_tokens)
        cache.free(request)
        assert_empty(cache)

    def test_windowed_prefix_hits_and_swaps(self, component):
        cache = self.windowed(component, *self.prefix_overrides, *self.swap_overrides)
        if not (cache.prefix_caching and cache.supports_swap):
            pytest.skip(f"cache={component} lacks prefix caching or swapping with these overrides")
        first = make_request("first", 30)
        assert compute(cache, first, 20) is not None and compute(cache, first, 10) is not None
        cache.free(first)
        second = make_request("second", 30)
        hit = cache.lookup_prefix(second)
        assert hit > 0, "the windowed group's blocks in the window were not found again"
        windowed, full = cache.block_tables(second)
        assert len(windowed) == len(full) == hit // cache.block_size
        second.num_computed_tokens = hit
        assert compute(cache, second, 30 - hit) is not None
        before = [list(table) for table in cache.block_tables(second)]
        assert cache.swap_out(second) is not None and cache.usage.used_blocks == 0
        assert cache.swap_in(second) is not None
        after = cache.block_tables(second)
        assert [[b == cache.null_block for b in t] for t in after] == [[b == cache.null_block for b in t]
                                                                       for t in before]
        cache.free(second)
        cache.shutdown()
        assert_empty(cache)

    def test_random_operations_never_leak_or_double_own(self, component):
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st

        operations = st.lists(st.tuples(st.sampled_from(["compute", "free", "fork", "rollback"]),
                                        st.integers(0, 5), st.integers(0, 5), st.integers(1, 24)), max_size=40)

        build = self.factory(component)

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(operations)
        def run(ops):
            play_random_operations(build(), ops)

        run()

    def test_random_operations_on_windowed_groups(self, component):
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st

        self.windowed(component)
        operations = st.lists(st.tuples(st.sampled_from(["compute", "free", "fork", "rollback"]),
                                        st.integers(0, 5), st.integers(0, 5), st.integers(1, 24)), max_size=40)
        build = self.factory(component, spec=WINDOWED_SPEC)

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(operations)
        def run(ops):
            play_random_operations(build(), ops)

        run()


def play_random_operations(cache: Any, ops: list[tuple[str, int, int, int]]) -> None:
    """Apply ``(operation, slot, other slot, tokens)`` steps to six request slots, checking
    after each that every block is in range, owned by one fork family only, counted once
    in ``usage``, that a table covers the computed tokens and nothing past the last
    ``truncate``, and that freeing everything leaves the cache empty."""
    live: dict[int, Request] = {}
    family: dict[str, int] = {}
    limit: dict[str, int] = {}
    serial = 0
    for op, slot, other, count in ops:
        request = live.get(slot)
        if op == "compute":
            if request is None:
                serial += 1
                request = live[slot] = make_request(f"r{serial}", SPEC.max_model_len, first=serial * 50)
                family[request.request_id] = serial
            count = min(count, SPEC.max_model_len - request.num_computed_tokens)
            if count and compute(cache, request, count, num_lookahead_tokens=count % 3) is not None:
                limit[request.request_id] = request.num_computed_tokens + 1
                cache.truncate(request, limit[request.request_id])
        elif op == "free" and request is not None:
            cache.free(live.pop(slot))
        elif op == "fork" and request is not None and other not in live and cache.supports_fork \
                and request.num_computed_tokens:
            serial += 1
            child = live[other] = make_request(f"r{serial}", SPEC.max_model_len, first=0)
            child.token_ids = list(request.token_ids)
            child.num_computed_tokens = limit[child.request_id] = request.num_computed_tokens
            family[child.request_id] = family[request.request_id]
            cache.fork(request, child)
        elif op == "rollback" and request is not None and request.num_computed_tokens > count:
            request.num_computed_tokens -= count
            limit[request.request_id] = request.num_computed_tokens
            cache.truncate(request, request.num_computed_tokens)
        check_ownership(cache, list(live.values()), family, limit)
    for request in live.values():
        cache.free(request)
    assert_empty(cache)


def check_ownership(cache: Any, requests: list[Request], family: dict[str, int], limit: dict[str, int]) -> None:
    """Blocks in range, no block twice in a request's tables (placeholder entries aside),
    shared only within a fork family, every table covering the computed tokens and no
    more than ``limit`` tokens, and
    ``usage.used_blocks`` equal to the distinct blocks held."""
    owner: dict[int, int] = {}
    for request in requests:
        rid = request.request_id
        held = [block for table in cache.block_tables(request) for block in held_blocks(cache, list(table))]
        assert len(set(held)) == len(held), f"{rid} holds a block twice: {cache.block_tables(request)}"
        for table in cache.block_tables(request):
            assert blocks_for(cache, request.num_computed_tokens) <= len(table) <= blocks_for(cache, limit.get(rid, 0)), \
                f"{rid}: {len(table)} blocks for {request.num_computed_tokens} computed tokens, truncated to {limit.get(rid)}"
        for block in held:
            assert 0 <= block < cache.num_blocks, f"block {block} out of range"
            assert owner.setdefault(block, family[rid]) == family[rid], f"block {block} is held by two unrelated requests"
    assert cache.usage.used_blocks == len(owner)
