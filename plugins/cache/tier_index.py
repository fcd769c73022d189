"""``cache.host_cache_bytes``: a tier of cached prefix blocks in host memory, below the device."""

from __future__ import annotations

from collections import OrderedDict


class HostTier:
    """Cached full blocks that left the device, in host blocks of the cache's host pool
    (the one swapping uses), least recently used first.

    Each entry is keyed by the block's chained hash and keeps its parent hash and tokens,
    so a lookup checks the content as the device's prefix cache does. A host block a load
    reads in the step being scheduled is pinned until that step's moves are taken; pinned
    blocks are never evicted (an offload of the same step would overwrite them first).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[int, int | None, tuple[int, ...]]] = OrderedDict()
        self._pinned: set[int] = set()
        self.stored_blocks = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: int) -> bool:
        return digest in self._entries

    def find(self, digest: int, parent: int | None, tokens: tuple[int, ...]) -> int | None:
        """The host block holding ``tokens`` after the block hashed ``parent`` (refreshed as
        most recently used and pinned for this step), or None."""
        entry = self._entries.get(digest)
        if entry is None or entry[1:] != (parent, tokens):
            return None
        self._entries.move_to_end(digest)
        self._pinned.add(entry[0])
        return entry[0]

    def touch(self, digest: int) -> None:
        """Mark an entry as most recently used."""
        self._entries.move_to_end(digest)

    def store(self, digest: int, parent: int | None, tokens: tuple[int, ...], host_block: int) -> None:
        """Keep a block's content in ``host_block``."""
        self._entries[digest] = (host_block, parent, tokens)
        self.stored_blocks += 1

    @property
    def full(self) -> bool:
        """True when the tier holds as many blocks as its budget allows."""
        return len(self._entries) >= self.capacity

    def evict(self) -> int | None:
        """Forget the least recently used entry not pinned; its host block (None: all pinned)."""
        for digest, (block, _, _) in self._entries.items():
            if block not in self._pinned:
                del self._entries[digest]
                return block
        return None

    def unpin_all(self) -> None:
        """The step's loads were handed out: nothing is pinned any more."""
        self._pinned.clear()

    def clear(self) -> list[int]:
        """Forget every entry; their host blocks."""
        blocks = [block for block, _, _ in self._entries.values()]
        self._entries.clear()
        self._pinned.clear()
        return blocks
