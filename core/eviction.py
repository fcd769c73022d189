"""The prefix-cache eviction contract: which cached, unreferenced block to reuse next."""

from __future__ import annotations

import abc


class EvictionPolicy(abc.ABC):
    """Tracks blocks that hold cached prefix content but no live request.

    The paged cache calls ``add`` when a cached block's last holder frees it, ``remove``
    when a prefix hit takes it back, and ``evict`` when it needs a free block.
    """

    def __init__(self, config: object = None):
        self.config = config

    @abc.abstractmethod
    def add(self, block: int) -> None:
        """A cached block became unreferenced."""

    @abc.abstractmethod
    def remove(self, block: int) -> None:
        """A cached block is referenced again (prefix hit)."""

    @abc.abstractmethod
    def evict(self) -> int:
        """Choose and forget one block to reuse."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of evictable blocks."""
