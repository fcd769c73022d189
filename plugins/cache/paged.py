"""PagedAttention's cache: blocks allocated as tokens arrive, shared copy-on-write,
reused by prefix, swapped to host memory under pressure."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Optional

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.kv_cache import (NO_TIER_MOVES, Allocation, CacheContext, KVCacheEvent, KVCacheGroup,
                                     KVCacheManager, KVCacheUsage, TierMoves, prefix_root, single_group)
from servelab.core.request import Request
from servelab.plugins.cache.block_pool import BlockPool
from servelab.core.kv_tier import KVTierContext, TierEntry
from servelab.plugins.cache.lower_tier import LowerTier
from servelab.plugins.cache.tier_index import TierIndex
from servelab.plugins.cache.prefix_cache import PrefixCache
from servelab.plugins.cache.radix_cache import RadixPrefixCache
from servelab.plugins.cache.sizing import num_blocks_for

# What allocate returns when the request's blocks already have room (shared: immutable).
NOTHING_NEW = Allocation()
PREFIX_INDEXES = {"hash": PrefixCache, "radix": RadixPrefixCache}
"""``cache.prefix_index``: how cached prefixes are found."""


@dataclass
class PagedCacheConfig:
    """``cache=paged``: ``block_size`` tokens per block; ``num_blocks`` blocks, or as many
    as fit ``memory_bytes`` when null, or, when that is null too, the executor's budget
    (512 MiB on the CPU; the device memory left after the weights in simulation). ``enable_prefix_caching`` reuses full blocks across
    requests, evicting with the registered policy ``eviction``; ``prefix_index``: ``hash``
    (whole blocks by their chained hash) or ``radix`` (also the leading tokens of a cached
    block a prompt diverges from, when no request holds that block, copied into a block of
    its own: ``RadixPrefixCache``; a model with several KV cache groups matches whole
    blocks). ``swap_space_bytes`` sizes
    the host pool used by ``scheduler.preemption=swap``; ``host_cache_bytes`` adds a tier
    of cached prefix blocks to it (``TierIndex``): a cached block evicted from the device
    moves there instead of vanishing, and a prefix hit there loads it back instead of
    recomputing it (needs prefix caching and one KV cache group). ``lower_tier`` (a
    registered ``kv_tier``: ``disk``) adds a tier below that, ``lower_tier_bytes`` big,
    kept at ``lower_tier_path``: blocks the host tier evicts are saved there, and a prefix
    hit there is loaded back through the host tier (``LowerTier``). ``kv_dtype``: auto (the model's
    dtype) | int8 | fp8_e4m3, the stored element type (docs/quantization.md); sizes from
    memory count its smaller blocks. ``groups``: one block table per KV cache group
    (``KVCacheSpec.groups``), windowed groups giving back the blocks that left their
    window; false keeps every layer's every token (as for a model without windows)."""

    block_size: int = 16
    num_blocks: Optional[int] = None
    memory_bytes: Optional[int] = None
    enable_prefix_caching: bool = False
    eviction: str = "lru"
    prefix_index: str = "hash"
    swap_space_bytes: int = 0
    host_cache_bytes: int = 0
    lower_tier: Optional[str] = None
    lower_tier_bytes: int = 0
    lower_tier_path: Optional[str] = None
    kv_dtype: str = "auto"
    groups: bool = True


class PagedKVCacheManager(KVCacheManager):
    """Block tables over a shared ``BlockPool``; a request holds ceil(tokens / block_size)
    blocks in each KV cache group. Blocks are reference counted: ``fork`` shares them and
    the first write into a shared partial block copies it (``Allocation.blocks_to_copy``).

    With several groups (a model whose layers differ in window) every group's table has
    one entry per block of the sequence, and the groups take their blocks from one pool:
    block ``b`` is the same slice of one set of tensors whichever group holds it. A
    windowed group's entries wholly before the window of the next token to compute point
    at ``null_block`` (one block past the pool's, never handed out or written, all zeros):
    their blocks went back to the pool, or to the prefix cache when it knows them.
    """

    def __init__(self, config: PagedCacheConfig, context: CacheContext):
        groups = context.spec.groups if getattr(config, "groups", True) else single_group(context.spec)
        num_blocks = num_blocks_for(config.num_blocks, config.memory_bytes, config.block_size, context, groups=groups)
        self._init_pool(config, context, config.block_size, num_blocks, groups)

    def _init_pool(self, config, context: CacheContext, block_size: int, num_blocks: int,
                   groups: tuple[KVCacheGroup, ...]) -> None:
        spec = context.spec
        self.config = config
        self.spec = spec
        self.block_size = block_size
        self.groups = groups
        self._windows = tuple(group.sliding_window for group in groups)
        self._windowed = tuple(index for index, window in enumerate(self._windows) if window is not None)
        self._layer_windows = tuple(window for window in spec.layer_windows if window)
        self.null_block = num_blocks if self._windowed else None
        self.num_blocks = num_blocks + bool(self._windowed)
        self.pool = BlockPool(num_blocks)
        self.lent_blocks = 0
        """Blocks lent out of the pool (``lend_blocks``), in none of ``usage``'s counts but the total."""
        self._tables: dict[str, list[list[int]]] = {}
        self._window_starts: dict[str, list[int]] = {}
        self._used_slots: dict[str, int] = {}
        self._tails: dict[str, int] = {}
        self._tail_sum = 0
        self._hashes: dict[str, list[int]] = {}
        self._looked_up: set[str] = set()
        self.prefix: PrefixCache | None = None
        self._pending_copies: dict[str, tuple[int, int]] = {}
        if getattr(config, "enable_prefix_caching", False):
            index = getattr(config, "prefix_index", "hash")
            if index not in PREFIX_INDEXES:
                raise ConfigError([f"cache.prefix_index must be one of {', '.join(PREFIX_INDEXES)}, got {index!r}"])
            policy = context.registry.get("eviction", config.eviction).cls()
            self.prefix = PREFIX_INDEXES[index](block_size, policy)
        block_bytes = spec.block_bytes(block_size, groups)
        swap_blocks = getattr(config, "swap_space_bytes", 0) // block_bytes
        tier_blocks = getattr(config, "host_cache_bytes", 0) // block_bytes
        self.host_tier = self._host_tier(config, tier_blocks, block_bytes, len(groups))
        self.num_host_blocks = swap_blocks + tier_blocks
        self.host_pool = BlockPool(self.num_host_blocks)
        self._host_tables: dict[str, list[list[int | None]]] = {}
        self._offloads: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._host_freed: list[int] = []
        self.lower = self._lower_tier(config, context, block_bytes)
        self._filling: set[int] = set()
        self._loading: set[str] = set()

    def _lower_tier(self, config, context: CacheContext, block_bytes: int) -> LowerTier | None:
        """The tier ``lower_tier`` asks for below the host tier (None: none); ``ConfigError``
        naming the field when it cannot work."""
        name = getattr(config, "lower_tier", None)
        if not name:
            return None
        spec = context.registry.get("kv_tier", name)
        wanted = config.lower_tier_bytes
        problems = []
        if self.host_tier is None:
            problems.append(f"cache.lower_tier={name} loads blocks through the host tier: set cache.host_cache_bytes "
                            f"(and cache.enable_prefix_caching=true)")
        if wanted < block_bytes:
            problems.append(f"cache.lower_tier_bytes={wanted} holds no block of {block_bytes} bytes")
        if problems:
            raise ConfigError(problems)
        layout = f"{context.model_fingerprint}/{self.block_size}/{block_bytes}".encode()
        fingerprint = hashlib.blake2b(layout, digest_size=12).hexdigest()
        lower = LowerTier(spec.cls(KVTierContext(config.lower_tier_path, wanted, block_bytes, fingerprint)))
        lower.on_forgotten = self._record_where
        return lower

    def _record_where(self, entry: TierEntry) -> None:
        """Record the cache event of a block that left a tier below the device: moved to the
        highest tier still holding it, or evicted from all (nothing while on the device)."""
        if self.prefix.events is None or self.prefix.find(0, entry.digest, entry.parent, entry.tokens) is not None:
            return
        if self.host_tier.holds(entry.digest, entry.parent, entry.tokens):
            self.prefix.record("moved", 0, entry.digest, "host")
        elif self.lower is not None and self.lower.index.holds(entry.digest, entry.parent, entry.tokens):
            self.prefix.record("moved", 0, entry.digest, self.config.lower_tier)
        else:
            self.prefix.record("evicted", 0, entry.digest)

    def _host_tier(self, config, tier_blocks: int, block_bytes: int, num_groups: int) -> TierIndex | None:
        """The host tier ``host_cache_bytes`` asks for (None: none); ``ConfigError`` naming
        the field when it cannot work."""
        wanted = getattr(config, "host_cache_bytes", 0)
        if not wanted:
            return None
        problems = []
        if self.prefix is None:
            problems.append("cache.host_cache_bytes keeps evicted prefix blocks: set cache.enable_prefix_caching=true")
        if num_groups > 1:
            problems.append(f"cache.host_cache_bytes needs one KV cache group; this model's layers form {num_groups} "
                            f"(set cache.groups=false)")
        if tier_blocks < 1:
            problems.append(f"cache.host_cache_bytes={wanted} holds no block of {block_bytes} bytes")
        if problems:
            raise ConfigError(problems)
        self.prefix.spill = self._offload
        return TierIndex(tier_blocks)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _set_used(self, rid: str, used: int) -> None:
        """Record the request's stored tokens and the unused slots at the end of its tables."""
        self._used_slots[rid] = used
        tables = self._tables.get(rid)
        tail = max(0, len(tables[0]) * self.block_size - used) * len(tables) if tables else 0
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

    def lend_blocks(self, count: int) -> list[int] | None:
        """``count`` blocks out of the pool for another use than a request's KV (a LoRA
        adapter's pages in a unified pool, ``core/lora_pool.py``), evicting prefix-cached
        blocks as an allocation would; None, with nothing taken, when too few are free."""
        blocks = self._take(count)
        if blocks is not None:
            self.lent_blocks += count
        return blocks

    def return_blocks(self, blocks: list[int]) -> None:
        """Give back blocks ``lend_blocks`` handed out."""
        self.pool.put_free(self.pool.release(blocks))
        self.lent_blocks -= len(blocks)

    def _take_host(self, count: int) -> list[int] | None:
        """``count`` host blocks, evicting the host tier's least recently used when the pool
        has too few free (None when that is not enough)."""
        while self.host_pool.num_free < count and self.host_tier is not None:
            block = self._evict_host()
            if block is None:
                break
            self.host_pool.put_free(self.host_pool.release([block]))
        return self.host_pool.take(count)

    def _evict_host(self) -> int | None:
        """Evict the host tier's least recently used entry not pinned, saving it to the
        lower tier when there is one; its host block (None: every entry is pinned)."""
        evicted = self.host_tier.evict()
        if evicted is None:
            return None
        block, entry = evicted
        if self.lower is not None:
            self.lower.spill(block, entry)
        self._record_where(entry)
        return block

    def _free_host(self, blocks: list[int]) -> None:
        """Give host blocks back; with a host tier only after this step's moves are taken
        (an offload of this step must not overwrite a block a swap-in still reads)."""
        unheld = self.host_pool.release(blocks)
        if self.host_tier is None:
            self.host_pool.put_free(unheld)
        else:
            self._host_freed += unheld

    def _offload(self, block: int, digest: int, parent: int | None, tokens: tuple[int, ...]) -> bool:
        """Keep an evicted device block's content in the host tier (a copy before the
        step); False when there is no room for it."""
        tier = self.host_tier
        if digest in tier:
            tier.touch(digest)
            return True
        if tier.full:
            host = self._evict_host()
            if host is None:
                return False
        else:
            taken = self._take_host(1)
            if taken is None:
                return False
            host = taken[0]
        tier.store(digest, parent, tokens, host)
        tier.pin(host)  # its content arrives with this step: a spill of this step would read it first
        self._offloads.append((block, host))
        return True

    def take_tier_moves(self) -> TierMoves:
        """The offloads, host-tier loads and lower-tier spills and fills since the last
        call; host blocks freed since become free and loaded ones evictable."""
        if self.host_tier is None:
            return NO_TIER_MOVES
        spills, fills = (), ()
        if self.lower is not None:
            self._finish_fills()
            spills, fills = self.lower.take_moves()
        moves = TierMoves(tuple(self._offloads), tuple(self._loads), spills, fills)
        if not (self._offloads or self._loads or spills or fills):
            moves = NO_TIER_MOVES
        self._offloads, self._loads = [], []
        if self._host_freed:
            self.host_pool.put_free(self._host_freed)
            self._host_freed = []
        self.host_tier.unpin_all()
        return moves

    def transfer_tier_blocks(self, spills: tuple, fills: tuple, read, write) -> None:
        """Hand the step's spills and fills to the lower tier's I/O (``LowerTier.transfer``)."""
        self.lower.transfer(spills, fills, read, write)

    @property
    def tier_hit_tokens(self) -> dict[str, int]:
        """Prompt tokens found in the host tier and the lower tier so far."""
        hits = {"host": self.host_tier.hit_tokens} if self.host_tier is not None else {}
        if self.lower is not None:
            hits[self.config.lower_tier] = self.lower.index.hit_tokens
        return hits

    def loading(self, request: Request) -> bool:
        """True while blocks of the request's prefix are loaded from the lower tier."""
        return request.request_id in self._loading

    def _finish_fills(self) -> None:
        """The lower tier's finished loads join the host tier (a failed one frees its
        staging block: that block is recomputed)."""
        for entry, host_block, ok in self.lower.finished_fills():
            self._filling.discard(entry.digest)
            if not ok or entry.digest in self.host_tier:
                self.host_pool.put_free(self.host_pool.release([host_block]))
                continue
            if self.host_tier.full:
                freed = self._evict_host()
                if freed is not None:
                    self._free_host([freed])
            self.host_tier.store(entry.digest, entry.parent, entry.tokens, host_block)

    def _fetch_from_lower(self, request: Request) -> bool:
        """Start loading, into staging host blocks, the lower tier's blocks that continue
        the request's cached prefix (on the device or in the host tier, pinned for this
        step); True while any of them is being loaded."""
        size, tokens, host, lower = self.block_size, request.token_ids, self.host_tier, self.lower
        parent = prefix_root(request.cache_salt)
        waiting = False
        for index in range((request.num_tokens - 1) // size):
            block_tokens = tuple(tokens[index * size:(index + 1) * size])
            digest = PrefixCache.chain_hash(parent, block_tokens)
            if self.prefix.find(0, digest, parent, block_tokens) is None and host.find(digest, parent, block_tokens) is None:
                if digest in self._filling:
                    waiting = True
                elif lower.index.find(digest, parent, block_tokens) is not None:
                    staging = self._take_host(1)
                    if staging is None:
                        break
                    lower.fill(TierEntry(digest, parent, block_tokens), staging[0])
                    self._filling.add(digest)
                    waiting = True
                else:
                    break
            parent = digest
        (self._loading.add if waiting else self._loading.discard)(request.request_id)
        return waiting

    def _release(self, blocks: list[int]) -> None:
        unheld = self.pool.release(blocks)
        if self.prefix is not None:
            for block in [b for b in unheld if self.prefix.is_cached(b)]:
                self.prefix.park(block)
            unheld = [b for b in unheld if not self.prefix.is_cached(b)]
        self.pool.put_free(unheld)

    def _live(self, table: list[int]) -> list[int]:
        """The table's blocks, the null block's entries left out."""
        null = self.null_block
        return table if null is None else [block for block in table if block != null]

    # -- the contract ----------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> Allocation | None:
        """Add blocks to every group's table until the request has room for its computed +
        new + lookahead tokens, copying a shared partial block before the first write into
        it; then give back the windowed groups' blocks that no token from here on reads."""
        rid = request.request_id
        tables = self._tables.get(rid) or [[] for _ in self.groups]
        computed = request.num_computed_tokens
        used = computed + num_new_tokens
        needed = max(0, self._blocks_for(min(used + num_lookahead_tokens, self.spec.max_model_len)) - len(tables[0]))
        write_index = computed // self.block_size
        shared = [index for index, table in enumerate(tables) if write_index < len(table)
                  and table[write_index] != self.null_block and self.pool.ref_counts[table[write_index]] > 1]
        count = needed * len(tables) + len(shared)
        taken = self._take(count) if count else []  # most decode steps: the last block has room
        if taken is None:
            return None
        pending = self._pending_copies.pop(rid, None)
        copies = [pending] if pending else []
        for index, fresh in zip(shared, taken):
            table = tables[index]
            copies.append((table[write_index], fresh))  # copy-on-write
            self._release([table[write_index]])
            table[write_index] = fresh
        added = taken[len(shared):]
        for index, table in enumerate(tables):
            table.extend(added[index * needed:(index + 1) * needed])
        self._tables[rid] = tables
        if self._windowed:
            self._leave_window(rid, tables, computed)
        self._set_used(rid, used)
        if self.prefix is not None:
            self._register_full_blocks(request, tables, used)
        if pending:  # the copy runs before this step writes; the source may go after it
            self._release([pending[0]])
        if not count and not pending:
            return NOTHING_NEW
        return Allocation(tuple(added) + tuple(d for _, d in copies[bool(pending):]), tuple(copies))

    def _leave_window(self, rid: str, tables: list[list[int]], computed: int) -> None:
        """Point each windowed group's entries wholly before the first key the token at
        ``computed`` reads (position computed - window + 1) at the null block."""
        starts = self._window_starts.setdefault(rid, [0] * len(tables))
        for index in self._windowed:
            table, start = tables[index], starts[index]
            first = min(max(0, computed - self._windows[index] + 1) // self.block_size, len(table))
            if first <= start:  # most steps: the window has not left another block
                continue
            gone = [block for block in table[start:first] if block != self.null_block]
            if gone:
                self._release(gone)
            table[start:first] = [self.null_block] * (first - start)
            starts[index] = first

    def _register_full_blocks(self, request: Request, tables: list[list[int]], used: int) -> None:
        size = self.block_size
        full = min(used // size, len(tables[0]))
        if full <= len(self._hashes.get(request.request_id, ())):
            return
        hashes = self._hashes.setdefault(request.request_id, [])
        for index in range(len(hashes), full):
            parent = hashes[-1] if hashes else prefix_root(request.cache_salt)
            tokens = tuple(request.token_ids[index * size:(index + 1) * size])
            for group, table in enumerate(tables):
                if table[index] != self.null_block:
                    self.prefix.register(table[index], parent, tokens, group)
            hashes.append(PrefixCache.chain_hash(parent, tokens))

    def free(self, request: Request) -> None:
        """Release the request's device and host blocks (idempotent)."""
        self._free_id(request.request_id)

    def _free_id(self, rid: str) -> None:
        self._forget_used(rid)
        tables = self._tables.pop(rid, None)
        self._window_starts.pop(rid, None)
        self._hashes.pop(rid, None)
        self._looked_up.discard(rid)
        self._loading.discard(rid)
        for table in tables or ():
            self._release(self._live(table))
        pending = self._pending_copies.pop(rid, None)
        if pending:
            self._release([pending[0]])
        host = self._host_tables.pop(rid, None)
        if host:
            self._free_host([b for table in host for b in table if b is not None])

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Release the blocks beyond ``num_tokens`` tokens."""
        rid = request.request_id
        tables = self._tables.get(rid)
        if tables is None:
            return
        keep = self._blocks_for(num_tokens)
        if keep < len(tables[0]):
            for table in tables:
                self._release(self._live(table[keep:]))
                del table[keep:]
            del self._hashes.get(rid, [])[keep:]
        self._set_used(rid, min(self._used_slots[rid], num_tokens))

    def block_table(self, request: Request) -> list[int]:
        """The request's blocks in position order, of the first group."""
        tables = self._tables.get(request.request_id)
        return tables[0] if tables else []

    def block_tables(self, request: Request) -> tuple[list[int], ...]:
        """The request's blocks in position order, of every group."""
        tables = self._tables.get(request.request_id)
        return tuple(tables) if tables else tuple([] for _ in self.groups)

    def max_tokens_per_request(self) -> int:
        """The tokens one request can hold with every group's table full (a prompt
        computed in one step needs all of its blocks in windowed groups too)."""
        return self.pool.num_blocks // len(self.groups) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Free blocks plus cached blocks that may be evicted."""
        return self.pool.num_free + (self.prefix.num_evictable if self.prefix else 0)

    @property
    def usage(self) -> KVCacheUsage:
        """Reserved = held blocks x block_size; used = reserved minus the unused tail slots
        of every table (shared blocks count once); cached = evictable; unread: see
        ``_unread_slots``."""
        cached = self.prefix.num_evictable if self.prefix else 0
        total = self.pool.num_blocks
        used_blocks = total - self.pool.num_free - cached - self.lent_blocks
        reserved = used_blocks * self.block_size
        return KVCacheUsage(
            total_slots=total * self.block_size,
            reserved_slots=reserved,
            used_slots=max(0, reserved - self._tail_sum),
            total_blocks=total,
            used_blocks=used_blocks,
            cached_blocks=cached,
            unread_slots=self._unread_slots() if self._layer_windows else 0,
        )

    def _unread_slots(self) -> int:
        """Held tokens that the next token's windows leave out: in a windowed group, those
        of its live blocks before the window; in one group that ignores its layers'
        windows, each windowed layer's tokens before its window, by its share of the
        group's layers (blocks shared between requests count for each)."""
        unread = 0.0
        for rid, tables in self._tables.items():
            used = self._used_slots.get(rid, 0)
            if self._windowed:
                starts = self._window_starts.get(rid) or [0] * len(tables)
                unread += sum(max(0, used - starts[index] * self.block_size - self._windows[index])
                              for index in self._windowed)
            else:
                unread += sum(max(0, used - window) for window in self._layer_windows) / self.spec.num_layers
        return int(unread)

    # -- prefix caching and sharing ---------------------------------------------------------------
    @property
    def prefix_caching(self) -> bool:
        """True when ``enable_prefix_caching`` is on."""
        return self.prefix is not None

    def lookup_prefix(self, request: Request) -> int:
        """Attach the cached full blocks that start the request's tokens (leaving at least
        its last token to compute): every block in each full group, the blocks the next
        token's window reads in each windowed group; with the radix index also the leading
        tokens of the next cached block (``_copy_partial``); returns the number of tokens found."""
        rid = request.request_id
        if self.prefix is None or rid in self._tables or rid in self._looked_up:
            return 0
        if self.lower is not None:
            self._finish_fills()
            if self._fetch_from_lower(request):
                return 0
        self._looked_up.add(rid)
        self.prefix.queried_tokens += request.num_tokens
        limit = (request.num_tokens - 1) // self.block_size
        found = self._cached_tables(request, limit)
        tables, hashes = found if found is not None else ([[] for _ in self.groups], [])
        self._hold(block for table in tables for block in self._live(table))
        if self.host_tier is not None:
            self._load_from_host(request, tables, hashes, limit)
        hit = len(hashes) * self.block_size + self._copy_partial(request, tables, hashes)
        if not hit:
            return 0
        self._tables[rid] = tables
        self._hashes[rid] = hashes
        if self._windowed:
            self._window_starts[rid] = [table.count(self.null_block) if self._windows[index] else 0
                                        for index, table in enumerate(tables)]
        self.prefix.hit_tokens += hit
        request.num_cached_prompt_tokens = min(hit, request.num_prompt_tokens)
        return hit

    def _hold(self, blocks) -> None:
        """Add a holder to each cached block (taking it out of the eviction pool if parked)."""
        blocks = list(blocks)
        for block in blocks:
            if self.pool.ref_counts[block] == 0:
                self.prefix.unpark(block)
        self.pool.share(blocks)

    def _load_from_host(self, request: Request, tables: list[list[int]], hashes: list[int], limit: int) -> None:
        """Extend the device match with the host tier's blocks: each into a fresh device
        block (loaded before the step, registered as cached at once), up to ``limit`` blocks."""
        size, tokens, tier = self.block_size, request.token_ids, self.host_tier
        while len(hashes) < limit:
            parent = hashes[-1] if hashes else prefix_root(request.cache_salt)
            block_tokens = tuple(tokens[len(hashes) * size:(len(hashes) + 1) * size])
            digest = PrefixCache.chain_hash(parent, block_tokens)
            host = tier.find(digest, parent, block_tokens)
            if host is None:
                return
            device = self._take(1)
            if device is None:
                return
            self.prefix.register(device[0], parent, block_tokens)
            tables[0].append(device[0])
            hashes.append(digest)
            self._loads.append((host, device[0]))
            tier.hit_tokens += size

    def _copy_partial(self, request: Request, tables: list[list[int]], hashes: list[int]) -> int:
        """With the radix index (one KV cache group): the leading tokens after the matched
        whole blocks that a parked cached block holds too (a block some request holds may
        be written by the step being scheduled, after the copy would read it). A fresh
        block joins the table and the cached one is held until the request's next
        ``allocate`` hands out the copy; returns the tokens reused (0: none, nothing changed)."""
        if not isinstance(self.prefix, RadixPrefixCache) or len(tables) > 1:
            return 0
        start = len(hashes) * self.block_size
        source, length = self.prefix.partial(request.token_ids[start:],
                                             hashes[-1] if hashes else prefix_root(request.cache_salt),
                                             request.num_tokens - 1 - start, lambda b: self.pool.ref_counts[b] == 0)
        if source is None:
            return 0
        self._hold([source])
        fresh = self._take(1)
        if fresh is None:
            self._release([source])
            return 0
        tables[0].append(fresh[0])
        self._pending_copies[request.request_id] = (source, fresh[0])
        self.prefix.partial_hit_tokens += length
        return length

    def _cached_tables(self, request: Request, limit: int) -> tuple[list[list[int]], list[int]] | None:
        """The longest run of at most ``limit`` blocks that every group holds (a windowed
        group: the blocks the token after the run reads), as (tables, hashes); None when
        nothing is cached."""
        prefix, size, tokens = self.prefix, self.block_size, request.token_ids
        root = prefix_root(request.cache_salt)
        full = [index for index, window in enumerate(self._windows) if window is None]
        runs = {index: prefix.match(tokens, limit, index, root)[0] for index in full}
        count = min((len(run) for run in runs.values()), default=limit)
        hashes = prefix.chain(tokens, count, root)
        found = {index: [prefix.find(index, digest, hashes[i - 1] if i else root, tuple(tokens[i * size:(i + 1) * size]))
                         for i, digest in enumerate(hashes)] for index in self._windowed}
        # latest[index][c]: the last block before c that the group lacks (-1: none)
        latest = {index: list(itertools.accumulate((i if block is None else -1 for i, block in enumerate(blocks)),
                                                   max, initial=-1)) for index, blocks in found.items()}
        while count:
            firsts = {index: max(0, count * size - self._windows[index] + 1) // size for index in self._windowed}
            if all(latest[index][count] < first for index, first in firsts.items()):
                break
            count -= 1
        if not count:
            return None
        for index, first in firsts.items():
            runs[index] = [self.null_block] * first + found[index][first:count]
        return [runs[index][:count] for index in range(len(self.groups))], hashes[:count]

    @property
    def prefix_hit_tokens(self) -> int:
        """Tokens served from the prefix cache so far."""
        return self.prefix.hit_tokens if self.prefix else 0

    @property
    def prefix_queried_tokens(self) -> int:
        """Tokens looked up in the prefix cache so far."""
        return self.prefix.queried_tokens if self.prefix else 0

    @property
    def prefix_evicted_blocks(self) -> int:
        """Cached blocks the eviction policy gave up so far."""
        return self.prefix.evictions if self.prefix else 0

    def start_events(self) -> None:
        """Record the prefix cache's stored and evicted blocks (with prefix caching)."""
        if self.prefix is not None and self.prefix.events is None:
            self.prefix.events = []

    def take_events(self) -> list[KVCacheEvent]:
        """The stored and evicted blocks since the last call."""
        if self.prefix is None or not self.prefix.events:
            return []
        events, self.prefix.events = self.prefix.events, []
        return events

    @property
    def supports_fork(self) -> bool:
        """Blocks can be shared between sequences."""
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Share the parent's blocks that hold the child's ``num_computed_tokens`` tokens."""
        tables = self._tables.get(parent.request_id)
        if tables is None:
            raise RuntimeError(f"fork: request {parent.request_id!r} holds no device blocks (swapped out or freed)")
        count = self._blocks_for(child.num_computed_tokens)
        shared = [list(table[:count]) for table in tables]
        for table in shared:
            self.pool.share(self._live(table))
        self._tables[child.request_id] = shared
        if parent.request_id in self._window_starts:
            self._window_starts[child.request_id] = [min(start, count) for start in
                                                     self._window_starts[parent.request_id]]
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
        tables = self._tables.get(rid) or []
        device = [block for table in tables for block in self._live(table)]
        host = self._take_host(len(device))
        if host is None:
            return None
        spare = iter(host)
        self._host_tables[rid] = [[None if block == self.null_block else next(spare) for block in table]
                                  for table in tables]
        self._release(device)
        self._tables.pop(rid, None)
        self._hashes.pop(rid, None)
        used = self._used_slots[rid]
        self._forget_used(rid)
        self._used_slots[rid] = used
        return list(zip(device, host))

    def can_swap_in(self, request: Request) -> bool:
        """True when enough device blocks are free for the swapped request."""
        host = self._host_tables.get(request.request_id, ())
        return sum(b is not None for table in host for b in table) <= self.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back: (host, device) pairs, or None when there is no room."""
        rid = request.request_id
        host_tables = self._host_tables[rid]
        host = [block for table in host_tables for block in table if block is not None]
        device = self._take(len(host))
        if device is None:
            return None
        del self._host_tables[rid]
        self._free_host(host)
        spare = iter(device)
        self._tables[rid] = [[self.null_block if block is None else next(spare) for block in table]
                             for table in host_tables]
        self._set_used(rid, self._used_slots[rid])
        return list(zip(host, device))

    def shutdown(self) -> None:
        """Free every request's blocks and evict every cached one: the whole pool is free."""
        for rid in {*self._tables, *self._host_tables}:
            self._free_id(rid)
        if self.prefix is not None:
            self.prefix.spill = None
            self.pool.put_free([self.prefix.evict() for _ in range(self.prefix.num_evictable)])
        if self.lower is not None:
            self._finish_fills()
            self.take_tier_moves()
            self.lower.close()
        if self.host_tier is not None:
            self.host_pool.put_free(self.host_pool.release(self.host_tier.clear()))
            self.take_tier_moves()


SPEC = ComponentSpec("cache", "paged", PagedKVCacheManager, PagedCacheConfig,
                     "PagedAttention block tables: blocks allocated as tokens arrive")
