"""Content-addressed full blocks for prefix reuse (hash chain + token check)."""

from __future__ import annotations

from typing import Callable, Sequence

from servelab.core.eviction import EvictionPolicy
from servelab.core.kv_cache import KVCacheEvent, block_hash, block_hashes


class PrefixCache:
    """Maps the hash of a full block's content, in each KV cache group, to the block
    holding it.

    A block's hash chains its parent's hash with its own token ids, so equal hashes mean
    equal prefixes; every hit also compares the stored token ids and parent hash, so a
    hash collision can never return wrong content. The groups of a cache hold the same
    tokens in different blocks, so a block is found by (group, hash). Unreferenced cached
    blocks of every group wait in one eviction policy until reused or evicted; the policy
    hears each block's content key, (group, hash), as it is cached and evicted.
    ``hit_tokens`` / ``queried_tokens`` count prompt tokens found / looked up, ``evictions``
    the blocks whose content was evicted; ``events`` (None: not recorded) the first
    group's stored, moved and evicted blocks as ``KVCacheEvent``s; ``spill`` (None:
    nothing) is called with each evicted block, its hash, parent hash and tokens before
    the content is forgotten, and answers whether a tier below kept it (``spill_tier``,
    its name: the event is then ``moved`` there).
    """

    def __init__(self, block_size: int, eviction: EvictionPolicy):
        self.block_size = block_size
        self.eviction = eviction
        self._block_of: dict[tuple[int, int], int] = {}
        self._entry: dict[int, tuple[int, int, int | None, tuple[int, ...]]] = {}
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.evictions = 0
        self.events: list[KVCacheEvent] | None = None
        self.spill: Callable[[int, int, int | None, tuple[int, ...]], bool] | None = None
        self.spill_tier = "host"

    @staticmethod
    def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
        """The hash of a block given its parent's hash and its token ids (``block_hash``)."""
        return block_hash(parent, tokens)

    def match(self, token_ids: Sequence[int], max_blocks: int, group: int = 0,
              root: int | None = None) -> tuple[list[int], list[int]]:
        """The longest run of ``group``'s cached full blocks at the start of ``token_ids``
        (at most ``max_blocks``, the first chained from ``root``): (blocks, their hashes)."""
        blocks: list[int] = []
        hashes: list[int] = []
        parent = root
        size = self.block_size
        for index in range(max_blocks):
            tokens = tuple(token_ids[index * size:(index + 1) * size])
            digest = self.chain_hash(parent, tokens)
            block = self.find(group, digest, parent, tokens)
            if block is None:
                break
            blocks.append(block)
            hashes.append(digest)
            parent = digest
        return blocks, hashes

    def chain(self, token_ids: Sequence[int], num_blocks: int, root: int | None = None) -> list[int]:
        """The hashes of the first ``num_blocks`` full blocks of ``token_ids`` (chained from ``root``)."""
        return block_hashes(token_ids, self.block_size, num_blocks, root)

    def find(self, group: int, digest: int, parent: int | None, tokens: tuple[int, ...]) -> int | None:
        """``group``'s block holding ``tokens`` after the block hashed ``parent``, or None."""
        block = self._block_of.get((group, digest))
        if block is None or self._entry[block][2:] != (parent, tokens):
            return None
        return block

    def register(self, block: int, parent: int | None, tokens: tuple[int, ...], group: int = 0) -> int:
        """Record a just-filled block of ``group``; returns its hash (the content may
        already be cached in another block, which then stays the canonical one)."""
        digest = self.chain_hash(parent, tokens)
        if (group, digest) not in self._block_of and block not in self._entry:
            self._block_of[group, digest] = block
            self._entry[block] = (group, digest, parent, tokens)
            self.eviction.on_cached(block, (group, digest))
            self.record("stored", group, digest)
        return digest

    def is_cached(self, block: int) -> bool:
        """True when the block holds registered content."""
        return block in self._entry

    def park(self, block: int) -> None:
        """An unreferenced cached block becomes evictable."""
        self.eviction.add(block)

    def unpark(self, block: int) -> None:
        """A parked block is referenced again."""
        self.eviction.remove(block)

    def evict(self) -> int:
        """Forget the content of the block the policy picks and return the block."""
        block = self.eviction.evict()
        kept = False
        if self.spill is not None:
            group, digest, parent, tokens = self._entry[block]
            kept = self.spill(block, digest, parent, tokens) and not group
        key = self._forget(block, "moved" if kept else "evicted")
        self.evictions += 1
        self.eviction.on_evicted(block, key)
        return block

    def _forget(self, block: int, kind: str = "evicted") -> tuple[int, int]:
        """Drop a block's content from the index, recording it as ``kind`` (evicted, or
        moved to ``spill_tier``); returns its key, (group, hash)."""
        group, digest = self._entry.pop(block)[:2]
        del self._block_of[group, digest]
        self.record(kind, group, digest, self.spill_tier if kind == "moved" else "device")
        return group, digest

    def record(self, kind: str, group: int, digest: int, tier: str = "device") -> None:
        """Note a first-group block stored, moved (to ``tier``) or evicted, while events
        are recorded (consecutive events of one kind and tier merge)."""
        events = self.events
        if events is None or group:
            return
        if events and (events[-1].kind, events[-1].tier) == (kind, tier):
            events[-1] = KVCacheEvent(kind, (*events[-1].hashes, digest), tier)
        else:
            events.append(KVCacheEvent(kind, (digest,), tier))

    @property
    def num_evictable(self) -> int:
        """Cached blocks that no request holds."""
        return len(self.eviction)
