"""Content-addressed full blocks for prefix reuse (hash chain + token check)."""

from __future__ import annotations

from typing import Sequence

from servelab.core.eviction import EvictionPolicy


class PrefixCache:
    """Maps the hash of a full block's content to the block holding it.

    A block's hash chains its parent's hash with its own token ids, so equal hashes mean
    equal prefixes; every hit also compares the stored token ids and parent hash, so a
    hash collision can never return wrong content. Unreferenced cached blocks wait in the
    eviction policy until reused or evicted.
    """

    def __init__(self, block_size: int, eviction: EvictionPolicy):
        self.block_size = block_size
        self.eviction = eviction
        self._block_of: dict[int, int] = {}
        self._entry: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}
        self.hit_tokens = 0
        self.queried_tokens = 0

    @staticmethod
    def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
        """The hash of a block given its parent's hash and its token ids."""
        return hash((parent, tokens))

    def match(self, token_ids: Sequence[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """The longest run of cached full blocks at the start of ``token_ids`` (at most
        ``max_blocks``): (blocks, their hashes)."""
        blocks: list[int] = []
        hashes: list[int] = []
        parent = None
        size = self.block_size
        for index in range(max_blocks):
            tokens = tuple(token_ids[index * size:(index + 1) * size])
            digest = self.chain_hash(parent, tokens)
            block = self._block_of.get(digest)
            if block is None or self._entry[block][1:] != (parent, tokens):
                break
            blocks.append(block)
            hashes.append(digest)
            parent = digest
        return blocks, hashes

    def register(self, block: int, parent: int | None, tokens: tuple[int, ...]) -> int:
        """Record a just-filled block; returns its hash (the content may already be cached
        in another block, which then stays the canonical one)."""
        digest = self.chain_hash(parent, tokens)
        if digest not in self._block_of and block not in self._entry:
            self._block_of[digest] = block
            self._entry[block] = (digest, parent, tokens)
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
        digest = self._entry.pop(block)[0]
        del self._block_of[digest]
        return block

    @property
    def num_evictable(self) -> int:
        """Cached blocks that no request holds."""
        return len(self.eviction)
