"""``cache.eviction=lru``: evict the cached block unused for the longest time."""

from __future__ import annotations

from collections import OrderedDict

from servelab.core.component import ComponentSpec
from servelab.core.eviction import EvictionPolicy


class LRUEviction(EvictionPolicy):
    """Least recently freed first; a prefix hit takes a block out of the queue."""

    def __init__(self, config: object = None):
        super().__init__(config)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def add(self, block: int) -> None:
        """Append as most recently used."""
        self._blocks[block] = None

    def remove(self, block: int) -> None:
        """Forget a block that is in use again."""
        self._blocks.pop(block, None)

    def evict(self) -> int:
        """The least recently used block."""
        block, _ = self._blocks.popitem(last=False)
        return block

    def __len__(self) -> int:
        return len(self._blocks)


SPEC = ComponentSpec("eviction", "lru", LRUEviction, None, "least recently used cached block first")
