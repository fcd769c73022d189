"""PagedAttention's cache: blocks of ``block_size`` slots allocated as tokens arrive."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servelab.core.component import ComponentSpec
from servelab.core.kv_cache import Allocation, KVCacheManager, KVCacheSpec, KVCacheUsage
from servelab.core.request import Request
from servelab.plugins.cache.block_pool import BlockPool
from servelab.plugins.cache.sizing import num_blocks_for


@dataclass
class PagedCacheConfig:
    """``cache=paged``: ``block_size`` tokens per block; ``num_blocks`` blocks, or as many
    as fit ``memory_bytes`` when ``num_blocks`` is null."""

    block_size: int = 16
    num_blocks: Optional[int] = None
    memory_bytes: int = 512 * 1024 * 1024


class PagedKVCacheManager(KVCacheManager):
    """Block tables per request over one shared ``BlockPool``; a request holds
    ceil(tokens / block_size) blocks, so at most one partial block is wasted."""

    def __init__(self, config: PagedCacheConfig, spec: KVCacheSpec):
        num_blocks = num_blocks_for(config.num_blocks, config.memory_bytes, config.block_size, spec)
        self._init_pool(config, spec, config.block_size, num_blocks)

    def _init_pool(self, config, spec: KVCacheSpec, block_size: int, num_blocks: int) -> None:
        self.config = config
        self.spec = spec
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._used_slots: dict[str, int] = {}

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> Allocation | None:
        """Add blocks until the request has room for its computed + new + lookahead tokens."""
        table = self._tables.get(request.request_id)
        held = len(table) if table else 0
        used = request.num_computed_tokens + num_new_tokens
        needed = self._blocks_for(min(used + num_lookahead_tokens, self.spec.max_model_len)) - held
        new_blocks: list[int] = []
        if needed > 0:
            taken = self.pool.take(needed)
            if taken is None:
                return None
            new_blocks = taken
        if table is None:
            table = self._tables[request.request_id] = []
        table.extend(new_blocks)
        self._used_slots[request.request_id] = used
        return Allocation(tuple(new_blocks))

    def free(self, request: Request) -> None:
        """Return every block of the request to the pool (idempotent)."""
        table = self._tables.pop(request.request_id, None)
        self._used_slots.pop(request.request_id, None)
        if table:
            self.pool.release(table)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Release the blocks beyond ``num_tokens`` tokens."""
        table = self._tables.get(request.request_id)
        if table is None:
            return
        keep = self._blocks_for(num_tokens)
        if keep < len(table):
            self.pool.release(table[keep:])
            del table[keep:]
        self._used_slots[request.request_id] = min(self._used_slots[request.request_id], num_tokens)

    def block_table(self, request: Request) -> list[int]:
        """The request's blocks in position order."""
        return self._tables.get(request.request_id, [])

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocations."""
        return self.pool.num_free

    @property
    def usage(self) -> KVCacheUsage:
        """Reserved = held blocks x block_size; used = tokens stored."""
        used_blocks = self.num_blocks - self.pool.num_free
        return KVCacheUsage(
            total_slots=self.num_blocks * self.block_size,
            reserved_slots=used_blocks * self.block_size,
            used_slots=sum(self._used_slots.values()),
            total_blocks=self.num_blocks,
            used_blocks=used_blocks,
        )


SPEC = ComponentSpec("cache", "paged", PagedKVCacheManager, PagedCacheConfig,
                     "PagedAttention block tables: blocks allocated as tokens arrive")
