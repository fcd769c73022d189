"""Adapter-aware admission and the unified adapter pool, on their own: which waiting
request is admitted next, how long one can be overtaken, and how adapters' pages move
in and out of a block pool."""

from __future__ import annotations

import pytest
import torch

from servelab.core.errors import ConfigError
from servelab.core.lora_adapter import LoRAAdapter, LoRAModule
from servelab.core.lora_admission import AdapterAdmission
from servelab.core.lora_pool import UnifiedAdapterPool
from servelab.core.request import Request
from servelab.core.sampling_params import SamplingParams
from servelab.plugins.cache.block_pool import BlockPool


def adapter(load_id: int, rank: int = 2) -> LoRAAdapter:
    """An adapter of ``rank`` on one 8x8 module: 32 rank-1 float32 weights per rank."""
    module = LoRAModule("m", torch.zeros(rank, 8), torch.zeros(8, rank))
    return LoRAAdapter(f"a{load_id}", "/nowhere", load_id, (module,))


def request(index: int, lora: LoRAAdapter | None) -> Request:
    made = Request(f"r{index}", [1, 2, 3], SamplingParams(max_tokens=1), None)
    made.lora = lora
    return made


class LendingPool:
    """The two calls the unified pool makes on a paged cache, over a ``BlockPool``."""

    def __init__(self, num_blocks: int):
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks

    def lend_blocks(self, count: int) -> list[int] | None:
        return self.pool.take(count)

    def return_blocks(self, blocks: list[int]) -> None:
        self.pool.put_free(self.pool.release(blocks))


def test_a_request_whose_adapter_does_not_fit_waits_while_active_adapters_overtake_it():
    a, b, c = adapter(1), adapter(2), adapter(3)
    admission = AdapterAdmission(2, max_bypass=64, resident=lambda: ())
    admission.start([request(0, a), request(1, b)])  # both slots' adapters are active
    waiting = [request(2, c), request(3, None), request(4, b), request(5, c)]
    picked = admission.pick(waiting, None)
    assert picked is waiting[1]  # the base model needs no slot; c does not fit
    waiting.remove(picked)
    assert admission.pick(waiting, None) is waiting[1]  # b is active
    assert admission.bypasses == 2


def test_the_first_request_is_overtaken_at_most_max_bypass_times():
    a, b = adapter(1), adapter(2)
    admission = AdapterAdmission(1, max_bypass=3, resident=lambda: ())
    admission.start([request(0, a)])
    waiting = [request(1, b)] + [request(2 + i, a) for i in range(10)]
    admitted = []
    while (picked := admission.pick(waiting, None)) is not None:
        waiting.remove(picked)
        admission.admitted(picked)
        admitted.append(picked.request_id)
    assert admitted == ["r2", "r3", "r4"] and waiting[0].request_id == "r1"
    admission.start([])  # a's requests finished: b fits now, and goes first
    assert admission.pick(waiting, None) is waiting[0]


def test_resident_adapters_go_first_while_there_is_room():
    a, b = adapter(1), adapter(2)
    admission = AdapterAdmission(2, max_bypass=8, resident=lambda: {2})
    admission.start([])
    waiting = [request(0, a), request(1, b)]
    assert admission.pick(waiting, None) is waiting[1]  # b is in a slot already, a needs a load
    admission.admitted(waiting.pop(1))
    assert admission.pick(waiting, None) is waiting[0]  # a still fits the second slot


def test_the_policy_orders_the_candidates():
    class Newest:
        def pick(self, waiting):
            return waiting[-1]

    a, b = adapter(1), adapter(2)
    admission = AdapterAdmission(1, max_bypass=8, resident=lambda: ())
    admission.start([request(0, a)])
    waiting = [request(1, a), request(2, b), request(3, a), request(4, None)]
    assert admission.pick(waiting, Newest()) is waiting[3]
    assert admission.pick(waiting[:2], Newest()) is waiting[0]  # b is the policy's first but does not fit


def test_unified_pool_pages_come_from_free_blocks_then_from_idle_adapters():
    cache = LendingPool(10)
    evicted = []
    pool = UnifiedAdapterPool(cache, block_bytes=64, element_bytes=4, max_resident=4, evict=evicted.append)
    small, large, other = adapter(1, rank=1), adapter(2, rank=4), adapter(3, rank=4)
    assert pool.pages(small) == 1 and pool.pages(large) == 4  # 16 weights of 4 bytes per rank, 64-byte blocks
    assert pool.hold(small, active=()) and pool.hold(large, active={1})
    assert cache.pool.num_free == 5
    assert pool.hold(other, active={2, 3})  # 4 free blocks: no eviction
    assert not pool.hold(adapter(4, rank=4), active={1, 2, 3})  # 1 free block, every adapter busy
    assert cache.pool.num_free == 1 and evicted == []
    assert pool.hold(adapter(4, rank=4), active={3, 4})  # the least recently used idle ones leave: small, large
    assert evicted == [1, 2] and pool.stats.evictions == 2
    assert pool.release_idle(busy={4}) and evicted == [1, 2, 3] and pool.stats.pressure_evictions == 1
    assert not pool.release_idle(busy={4})
    pool.drop(adapter(4))
    pool.release_unloaded(active={4})
    assert pool.stats.adapters == 1  # still running
    pool.release_unloaded(active=())
    assert pool.stats == pool.stats.__class__(0, 0, 4, 2, 1) and cache.pool.num_free == 10


def test_unified_pool_caps_resident_adapters_at_the_slots():
    cache = LendingPool(100)
    pool = UnifiedAdapterPool(cache, block_bytes=64, element_bytes=4, max_resident=2, evict=lambda load_id: None)
    assert pool.hold(adapter(1), ()) and pool.hold(adapter(2), ())
    assert not pool.hold(adapter(3), active={1, 2})
    assert pool.hold(adapter(3), active={2}) and list(pool.held) == [2, 3]
    pool.close()
    assert cache.pool.num_free == 100 and not pool.held


def test_unified_pool_needs_a_cache_that_lends_blocks():
    with pytest.raises(ConfigError, match="cache=paged"):
        UnifiedAdapterPool(object(), 64, 4, 2, lambda load_id: None)
