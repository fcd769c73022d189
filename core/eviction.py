"""The prefix-cache eviction contract: which cached, unreferenced block to reuse next."""

from __future__ import annotations

import abc


class EvictionPolicy(abc.ABC):
    """Tracks blocks that hold cached prefix content but no live request.

    The paged cache calls ``add`` when a cached block's last holder frees it, ``remove``
    when a prefix hit takes it back, and ``evict`` when it needs a free block. A policy
    that learns from content (ARC's ghost lists) also hears ``on_cached`` when content is
    cached in a block and ``on_evicted`` after a block's content was evicted; ``key``
    identifies the content (equal keys, equal tokens after an equal prefix).
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

    def on_cached(self, block: int, key: object) -> None:
        """Content ``key`` was cached in ``block`` (a block just filled); nothing by default."""

    def on_evicted(self, block: int, key: object) -> None:
        """``evict`` returned ``block``, whose content ``key`` is forgotten; nothing by default."""
