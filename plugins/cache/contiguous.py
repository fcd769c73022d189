"""The pre-PagedAttention baseline: one ``max_model_len`` reservation per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servelab.core.component import ComponentSpec
from servelab.core.kv_cache import CacheContext
from servelab.plugins.cache.paged import PagedKVCacheManager
from servelab.plugins.cache.sizing import num_blocks_for


@dataclass
class ContiguousCacheConfig:
    """``cache=contiguous``: ``num_slots`` request reservations of ``max_model_len`` tokens,
    or as many as fit ``memory_bytes`` when ``num_slots`` is null, or the executor's budget
    when both are null."""

    num_slots: Optional[int] = None
    memory_bytes: Optional[int] = None


class ContiguousKVCacheManager(PagedKVCacheManager):
    """Each admitted request reserves one contiguous region of ``max_model_len`` slots.

    This is the paged manager with ``block_size = max_model_len``: the first allocation
    takes the request's single region, so the same attention path serves both caches, and
    the unused tail of every region is the waste that PagedAttention removes.
    """

    def __init__(self, config: ContiguousCacheConfig, context: CacheContext):
        block_size = context.spec.max_model_len
        num_slots = num_blocks_for(config.num_slots, config.memory_bytes, block_size, context,
                                   group="cache (contiguous)")
        self._init_pool(config, context, block_size, num_slots)

    @property
    def supports_fork(self) -> bool:
        """The baseline never shares regions between sequences."""
        return False


SPEC = ComponentSpec("cache", "contiguous", ContiguousKVCacheManager, ContiguousCacheConfig,
                     "one max_model_len reservation per request (pre-PagedAttention baseline)")
