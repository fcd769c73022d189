"""PagedAttention's cache: blocks allocated as tokens arrive, shared copy-on-write,
reused by prefix, swapped to host memory under pressure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servelab.core.component import ComponentSpec
from servelab.core.kv_cache import Allocation, CacheContext, KVCacheManager, KVCacheUsage
from servelab.core.request import Request
from servelab.plugins.cache.block_pool import BlockPool
from servelab.plugins.cache.prefix_cache import PrefixCache
from servelab.plugins.cache.sizing import num_blocks_for

# What allocate returns when the request's blocks already have room (shared: immutable).
NOTHING_NEW = Allocation()


@dataclass
class PagedCacheConfig:
    """``cache=paged``: ``block_size`` tokens per block; ``num_blocks`` blocks, or as many
    as fit ``memory_bytes`` when null, or, when that is null too, the executor's budget
    (512 MiB on the CPU; the device memory left after the weights in simulation). ``enable_prefix_caching`` reuses full blocks across
    requests, evicting with the registered policy ``eviction``. ``swap_space_bytes`` sizes
    the host pool used by ``scheduler.preemption=swap``. ``kv_dtype``: auto (the model's
    dtype) | int8 | fp8_e4m3, the stored element type (docs/quantization.md); sizes from
    memory count its smaller blocks."""

    block_size: int = 16
    num_blocks: Optional[int] = None
    memory_bytes: Optional[int] = None
    enable_prefix_caching: bool = False
    eviction: str = "lru"
    swap_space_bytes: int = 0
    kv_dtype: str = "auto"


class PagedKVCacheManager(KVCacheManager):
    """Block tables over a shared ``BlockPool``; a request holds ceil(tokens / block_size)
    blocks. Blocks are reference counted: ``fork`` shares them and the first write into a
    shared partial block copies it (``Allocation.blocks_to_copy``)."""

    def __init__(self, config: PagedCacheConfig, context: CacheContext):
        num_blocks = num_blocks_for(config.num_blocks, config.memory_bytes, config.block_size, context)
        self._init_pool(config, context, config.block_size, num_blocks)

    def _init_pool(self, config, context: CacheContext, block_size: int, num_blocks: int) -> None:
        spec = context.spec
        self.config = config
        self.spec = spec
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._used_slots: dict[str, int] = {}
        self._tails: dict[str, int] = {}
        self._tail_sum = 0
        self._hashes: dict[str, list[int]] = {}
        self._looked_up: set[str] = set()
        self.prefix: PrefixCache | None = None
        if getattr(config, "enable_prefix_caching", False):
            policy = context.registry.get("eviction", config.eviction).cls()
            self.prefix = PrefixCache(block_size, policy)
        swap_bytes = getattr(config, "swap_space_bytes", 0)
        self.num_host_blocks = swap_bytes // (spec.bytes_per_token * block_size)
        self.host_pool = BlockPool(self.num_host_blocks)
        self._host_tables: dict[str, list[int]] = {}

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _set_used(self, rid: str, used: int) -> None:
        """Record the request's stored tokens and the unused slots at the end of its table."""
        self._used_slots[rid] = used
        tail = max(0, len(self._tables.get(rid, ())) * self.block_size - used)
        self._tail_sum += tail - self._tails.get(rid, 0)
        self._tails[rid] = tail

    def _forget_used(self, rid: str) -> None:
        self._used_slots.pop(rid, None)
        self._tail_sum -= self._tails.pop(rid, 0)

    # -- taking and returning blocks ---------------------------------------------------------
    def _take(self, count: int) -> list[int] | None:
        shortfall = count - self.pool.num_free
        if shortfall > 0:
            if self.prefix is None or self.prefix.num_evictable < shortfall:
                return None
            self.pool.put_free([self.prefix.evict() for _ in range(shortfall)])
        return self.pool.take(count)

    def _release(self, blocks: list[int]) -> None:
        unheld = self.pool.release(blocks)
        if self.prefix is not None:
            for block in [b for b in unheld if self.prefix.is_cached(b)]:
                self.prefix.park(block)
            unheld = [b for b in unheld if not self.prefix.is_cached(b)]
        self.pool.put_free(unheld)

    # -- the contract ----------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> Allocation | None:
        """Add blocks until the request has room for its computed + new + lookahead tokens,
        copying a shared partial block before the first write into it."""
        rid = request.request_id
        table = self._tables.get(rid, [])
        computed = request.num_computed_tokens
        used = computed + num_new_tokens
        needed = max(0, self._blocks_for(min(used + num_lookahead_tokens, self.spec.max_model_len)) - len(table))
        write_index = computed // self.block_size
        copy_on_write = write_index < len(table) and self.pool.ref_counts[table[write_index]] > 1
        count = needed + copy_on_write
        taken = self._take(count) if count else []  # most decode steps: the last block has room
        if taken is None:
            return None
        copies: tuple[tuple[int, int], ...] = ()
        if copy_on_write:
            fresh = taken[-1]
            copies = ((table[write_index], fresh),)
            self._release([table[write_index]])
            table[write_index] = fresh
            taken = taken[:-1]
        table.extend(taken)
        self._tables[rid] = table
        self._set_used(rid, used)
        if self.prefix is not None:
            self._register_full_blocks(request, table, used)
        if not count:
            return NOTHING_NEW
        return Allocation(tuple(taken) + tuple(d for _, d in copies), copies)

    def _register_full_blocks(self, request: Request, table: list[int], used: int) -> None:
        size = self.block_size
        full = min(used // size, len(table))
        if full <= len(self._hashes.get(request.request_id, ())):
            return
        hashes = self._hashes.setdefault(request.request_id, [])
        for index in range(len(hashes), full):
            parent = hashes[-1] if hashes else None
            tokens = tuple(request.token_ids[index * size:(index + 1) * size])
            hashes.append(self.prefix.register(table[index], parent, tokens))

    def free(self, request: Request) -> None:
        """Release the request's device and host blocks (idempotent)."""
        self._free_id(request.request_id)

    def _free_id(self, rid: str) -> None:
        self._forget_used(rid)
        table = self._tables.pop(rid, None)
        self._hashes.pop(rid, None)
        self._looked_up.discard(rid)
        if table:
            self._release(table)
        host = self._host_tables.pop(rid, None)
        if host:
            self.host_pool.put_free(self.host_pool.release(host))

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Release the blocks beyond ``num_tokens`` tokens."""
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        keep = self._blocks_for(num_tokens)
        if keep < len(table):
            self._release(table[keep:])
            del table[keep:]
            del self._hashes.get(rid, [])[keep:]
        self._set_used(rid, min(self._used_slots[rid], num_tokens))

    def block_table(self, request: Request) -> list[int]:
        """The request's blocks in position order."""
        return self._tables.get(request.request_id, [])

    @property
    def num_free_blocks(self) -> int:
        """Free blocks plus cached blocks that may be evicted."""
        return self.pool.num_free + (self.prefix.num_evictable if self.prefix else 0)

    @property
    def usage(self) -> KVCacheUsage:
        """Reserved = held blocks x block_size; used = reserved minus the unused tail slots
        of every table (shared blocks count once); cached = evictable."""
        cached = self.prefix.num_evictable if self.prefix else 0
        used_blocks = self.num_blocks - self.pool.num_free - cached
        reserved = used_blocks * self.block_size
        return KVCacheUsage(
            total_slots=self.num_blocks * self.block_size,
            reserved_slots=reserved,
            used_slots=max(0, reserved - self._tail_sum),
            total_blocks=self.num_blocks,
            used_blocks=used_blocks,
            cached_blocks=cached,
        )

    # -- prefix caching and sharing ---------------------------------------------------------------
    @property
    def prefix_caching(self) -> bool:
        """True when ``enable_prefix_caching`` is on."""
        return self.prefix is not None

    def lookup_prefix(self, request: Request) -> int:
        """Attach the cached full blocks that start the request's tokens (leaving at least
        its last token to compute); returns the number of tokens found."""
        rid = request.request_id
        if self.prefix is None or rid in self._tables or rid in self._looked_up:
            return 0
        self._looked_up.add(rid)
        self.prefix.queried_tokens += request.num_tokens
        blocks, hashes = self.prefix.match(request.token_ids, (request.num_tokens - 1) // self.block_size)
        if not blocks:
            return 0
        for block in blocks:
            if self.pool.ref_counts[block] == 0:
                self.prefix.unpark(block)
        self.pool.share(blocks)
        self._tables[rid] = list(blocks)
        self._hashes[rid] = hashes
        hit = len(blocks) * self.block_size
        self.prefix.hit_tokens += hit
        request.num_cached_prompt_tokens = min(hit, request.num_prompt_tokens)
        return hit

    @property
    def prefix_hit_tokens(self) -> int:
        """Tokens served from the prefix cache so far."""
        return self.prefix.hit_tokens if self.prefix else 0

    @property
    def prefix_queried_tokens(self) -> int:
        """Tokens looked up in the prefix cache so far."""
        return self.prefix.queried_tokens if self.prefix else 0

    @property
    def supports_fork(self) -> bool:
        """Blocks can be shared between sequences."""
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Share the parent's blocks that hold the child's ``num_computed_tokens`` tokens."""
        table = self._tables.get(parent.request_id)
        if table is None:
            raise RuntimeError(f"fork: request {parent.request_id!r} holds no device blocks (swapped out or freed)")
        count = self._blocks_for(child.num_computed_tokens)
        shared = table[:count]
        self.pool.share(shared)
        self._tables[child.request_id] = list(shared)
        full = child.num_computed_tokens // self.block_size
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, [])[:full])
        self._set_used(child.request_id, child.num_computed_tokens)

    # -- swapping ------------------------------------------------------------------------------------
    @property
    def supports_swap(self) -> bool:
        """True when a host pool was configured."""
        return self.num_host_blocks > 0

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host pool: (device, host) pairs, or None when full."""
        rid = request.request_id
        table = self._tables.get(rid, [])
        host = self.host_pool.take(len(table))
        if host is None:
            return None
        self._release(table)
        self._tables.pop(rid, None)
        self._hashes.pop(rid, None)
        used = self._used_slots[rid]
        self._forget_used(rid)
        self._used_slots[rid] = used
        self._host_tables[rid] = host
        return list(zip(table, host))

    def can_swap_in(self, request: Request) -> bool:
        """True when enough device blocks are free for the swapped request."""
        return len(self._host_tables.get(request.request_id, ())) <= self.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back: (host, device) pairs, or None when there is no room."""
        rid = request.request_id
        host = self._host_tables[rid]
        device = self._take(len(host))
        if device is None:
            return None
        del self._host_tables[rid]
        self.host_pool.put_free(self.host_pool.release(host))
        self._tables[rid] = device
        self._set_used(rid, self._used_slots[rid])
        return list(zip(host, device))

    def shutdown(self) -> None:
        """Free every request's blocks and evict every cached one: the whole pool is free."""
        for rid in {*self._tables, *self._host_tables}:
            self._free_id(rid)
        if self.prefix is not None:
            self.pool.put_free([self.prefix.evict() for _ in range(self.prefix.num_evictable)])


SPEC = ComponentSpec("cache", "paged", PagedKVCacheManager, PagedCacheConfig,
                     "PagedAttention block tables: blocks allocated as tokens arrive")
