"""S-LoRA's unified memory pool (``lora.unified_pool=true``): LoRA adapters and the KV
cache share one budget of blocks.

An adapter resident on the device holds pages that are KV cache blocks, taken from the
cache's block pool (``lend_blocks``): ceil(its bytes on the device / one block's bytes)
of them, so a rank-8 adapter costs less than a rank-64 one. When an adapter needs room,
free KV blocks (and evictable prefix-cached ones) are used first, then the pages of the
least recently used idle adapter (one no request holding cache runs with); when the KV
cache runs out, idle adapters give their pages back (``release_idle``) before any
request is preempted. Adapters that running requests use are never evicted. The pages
are the budget: the weights themselves are read from the adapter slots (``lora_slots``),
which hold at most ``max_resident`` adapters.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Collection

from servelab.core.errors import ConfigError, InvalidRequestError
from servelab.core.lora_adapter import LoRAAdapter


@dataclass(frozen=True, slots=True)
class AdapterPoolStats:
    """The unified pool so far: ``adapters`` resident and the KV ``blocks`` their pages
    take now; ``loads`` (an adapter given pages), ``evictions`` (pages taken back for
    another adapter) and ``pressure_evictions`` (pages given back to the KV cache)."""

    adapters: int
    blocks: int
    loads: int
    evictions: int
    pressure_evictions: int


class UnifiedAdapterPool:
    """Adapters' pages in ``cache``'s block pool (module docstring): blocks of
    ``block_bytes``, adapters at ``element_bytes`` per weight split over ``shards``
    tensor-parallel ranks, at most ``max_resident`` at once; ``evict(load_id)`` tells the
    executor an adapter left the device."""

    def __init__(self, cache: Any, block_bytes: int, element_bytes: int, max_resident: int,
                 evict: Callable[[int], None], shards: int = 1, request_blocks: int = 0):
        if not callable(getattr(cache, "lend_blocks", None)):
            raise ConfigError([f"lora.unified_pool=true shares the KV cache's block pool with adapters: it needs "
                               f"cache=paged ({type(cache).__name__} lends no blocks)"])
        self.cache, self.block_bytes, self.element_bytes = cache, block_bytes, element_bytes
        self.max_resident, self.evict, self.shards = max_resident, evict, shards
        self.room = cache.num_blocks - request_blocks
        """The most pages one adapter may take: the blocks left beside a longest request's."""
        self.held: OrderedDict[int, list[int]] = OrderedDict()  # load id -> its pages, least recently used first
        self.unloaded: set[int] = set()  # load ids of adapters no new request can name
        self.loads = self.evictions = self.pressure_evictions = 0

    def pages(self, adapter: LoRAAdapter) -> int:
        """Blocks ``adapter`` takes on one rank."""
        weights = adapter.num_bytes // 4  # read as float32
        return -(-weights * self.element_bytes // self.shards // self.block_bytes)

    def check(self, adapter: LoRAAdapter) -> None:
        """``InvalidRequestError`` on ``lora`` when ``adapter``'s pages leave no room in the
        KV cache for a request of ``model.max_model_len`` tokens beside them."""
        if self.pages(adapter) > self.room:
            raise InvalidRequestError("lora", f"adapter {adapter.name!r} takes {self.pages(adapter)} KV cache blocks "
                                              f"in the unified pool (lora.unified_pool), more than the "
                                              f"{max(self.room, 0)} left beside a request of model.max_model_len "
                                              f"tokens; raise cache.num_blocks / cache.memory_bytes")

    @property
    def stats(self) -> AdapterPoolStats:
        """Counters so far."""
        return AdapterPoolStats(len(self.held), sum(map(len, self.held.values())), self.loads, self.evictions,
                                self.pressure_evictions)

    def hold(self, adapter: LoRAAdapter, active: Collection[int]) -> bool:
        """Make ``adapter`` resident (pages from free KV blocks, then from idle adapters not
        in ``active``); False, with nothing taken, when there is no room."""
        load_id = adapter.load_id
        if load_id in self.held:
            self.held.move_to_end(load_id)
            return True
        if len(self.held) >= self.max_resident and not self._evict_idle(active):
            return False
        count = self.pages(adapter)
        blocks = self.cache.lend_blocks(count)
        while blocks is None and self._evict_idle(active):
            blocks = self.cache.lend_blocks(count)
        if blocks is None:
            return False
        self.held[load_id] = blocks
        self.loads += 1
        return True

    def _evict_idle(self, busy: Collection[int]) -> bool:
        """Give back the least recently used idle adapter's pages; False when none is idle."""
        victim = next((load_id for load_id in self.held if load_id not in busy), None)
        if victim is None:
            return False
        self._release(victim)
        self.evictions += 1
        return True

    def release_idle(self, busy: Collection[int]) -> bool:
        """KV pressure: give one idle adapter's pages back to the cache (False: none idle)."""
        if not self._evict_idle(busy):
            return False
        self.evictions -= 1
        self.pressure_evictions += 1
        return True

    def drop(self, adapter: LoRAAdapter) -> None:
        """``adapter`` was unloaded: its pages go back once no request runs with it (and
        again after a request preempted meanwhile took it back)."""
        self.unloaded.add(adapter.load_id)

    def release_unloaded(self, active: Collection[int]) -> None:
        """Give back the pages of unloaded adapters no request in ``active`` runs with."""
        for load_id in [load_id for load_id in self.held if load_id in self.unloaded and load_id not in active]:
            self._release(load_id)

    def _release(self, load_id: int) -> None:
        self.cache.return_blocks(self.held.pop(load_id))
        self.evict(load_id)

    def close(self) -> None:
        """Give every page back (the engine shuts down)."""
        for load_id in list(self.held):
            self._release(load_id)
