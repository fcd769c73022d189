"""``cache.eviction=arc``: adaptive replacement between recency and frequency (ARC)."""

from __future__ import annotations

from collections import OrderedDict

from servelab.core.component import ComponentSpec
from servelab.core.eviction import EvictionPolicy


class ARCEviction(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST'03) over the evictable blocks.

    Parked blocks whose content was never reused since it was cached wait in ``recent``,
    those reused at least once in ``frequent``, each least recently freed first. Eviction
    takes from ``recent`` while it is longer than the target ``p``, else from
    ``frequent``, and remembers the evicted content in a ghost list of its side. When
    content is cached again that a ghost list remembers, the policy learns: a ``recent``
    ghost raises ``p`` (recency was evicted too eagerly), a ``frequent`` ghost lowers it.
    Ghost lists hold at most as many entries as the most blocks ever parked at once."""

    def __init__(self, config: object = None):
        super().__init__(config)
        self.recent: OrderedDict[int, None] = OrderedDict()
        self.frequent: OrderedDict[int, None] = OrderedDict()
        self.recent_ghosts: OrderedDict[object, None] = OrderedDict()
        self.frequent_ghosts: OrderedDict[object, None] = OrderedDict()
        self.target = 0.0
        self._reused: set[int] = set()
        self._capacity = 1
        self._evicted_side = self.recent

    def on_cached(self, block: int, key: object) -> None:
        """New content in ``block``: adapt ``p`` when a ghost list remembers it; content a
        ghost list held counts as reused."""
        self._reused.discard(block)
        if key in self.recent_ghosts:
            self.target = min(float(self._capacity),
                              self.target + max(1.0, len(self.frequent_ghosts) / len(self.recent_ghosts)))
            del self.recent_ghosts[key]
            self._reused.add(block)
        elif key in self.frequent_ghosts:
            self.target = max(0.0, self.target - max(1.0, len(self.recent_ghosts) / len(self.frequent_ghosts)))
            del self.frequent_ghosts[key]
            self._reused.add(block)

    def add(self, block: int) -> None:
        """Park a block on the side its reuse puts it."""
        (self.frequent if block in self._reused else self.recent)[block] = None
        self._capacity = max(self._capacity, len(self))

    def remove(self, block: int) -> None:
        """A hit: the block leaves the pool and counts as reused."""
        for side in (self.recent, self.frequent):
            if block in side:
                del side[block]
                self._reused.add(block)

    def evict(self) -> int:
        """The least recently freed block of ``recent`` while it exceeds ``p`` (or
        ``frequent`` is empty), else of ``frequent``."""
        side = self.recent if self.recent and (len(self.recent) > self.target or not self.frequent) else self.frequent
        block, _ = side.popitem(last=False)
        self._evicted_side = side
        return block

    def on_evicted(self, block: int, key: object) -> None:
        """Remember the evicted content in the ghost list of its side."""
        ghosts = self.recent_ghosts if self._evicted_side is self.recent else self.frequent_ghosts
        ghosts[key] = None
        while len(ghosts) > self._capacity:
            ghosts.popitem(last=False)
        self._reused.discard(block)

    def __len__(self) -> int:
        return len(self.recent) + len(self.frequent)


SPEC = ComponentSpec("eviction", "arc", ARCEviction, None,
                     "adaptive replacement (ARC): balances recently and frequently reused blocks, learning from ghosts")
