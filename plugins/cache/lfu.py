"""``cache.eviction=lfu``: evict the cached block reused the fewest times."""

from __future__ import annotations

import heapq
import itertools

from servelab.core.component import ComponentSpec
from servelab.core.eviction import EvictionPolicy


class LFUEviction(EvictionPolicy):
    """Fewest prefix hits since its content was cached first; among equals the least
    recently freed. A block's count starts at 0 when content is cached in it and grows by
    one with each hit that takes it back (``remove``)."""

    def __init__(self, config: object = None):
        super().__init__(config)
        self._hits: dict[int, int] = {}
        self._parked: dict[int, int] = {}
        self._heap: list[tuple[int, int, int]] = []
        self._order = itertools.count()

    def on_cached(self, block: int, key: object) -> None:
        """New content: its hit count starts at 0."""
        self._hits[block] = 0

    def add(self, block: int) -> None:
        """Park a block, ranked by its hits, then by when it was freed."""
        order = next(self._order)
        self._parked[block] = order
        heapq.heappush(self._heap, (self._hits.get(block, 0), order, block))

    def remove(self, block: int) -> None:
        """A hit: the block leaves the pool and counts one more reuse."""
        if self._parked.pop(block, None) is not None:
            self._hits[block] = self._hits.get(block, 0) + 1

    def evict(self) -> int:
        """The parked block with the fewest hits (stale heap entries are skipped)."""
        while True:
            _, order, block = heapq.heappop(self._heap)
            if self._parked.get(block) == order:
                del self._parked[block]
                self._hits.pop(block, None)
                return block

    def __len__(self) -> int:
        return len(self._parked)


SPEC = ComponentSpec("eviction", "lfu", LFUEviction, None, "fewest prefix hits first, then least recently used")
