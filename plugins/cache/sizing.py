"""How many blocks a cache gets from its config."""

from __future__ import annotations

from servelab.core.errors import ConfigError
from servelab.core.kv_cache import CacheContext, KVCacheGroup


def num_blocks_for(num_blocks: int | None, memory_bytes: int | None, block_size: int, context: CacheContext,
                   group: str = "cache", groups: tuple[KVCacheGroup, ...] | None = None) -> int:
    """``num_blocks`` when set, else as many blocks of ``block_size`` tokens as fit
    ``memory_bytes``, or, when that is unset too, the executor's memory budget (a block
    holds one KV cache group's layers, ``KVCacheSpec.block_bytes``)."""
    if block_size < 1:
        raise ConfigError([f"{group}.block_size must be >= 1, got {block_size}"])
    if num_blocks is not None:
        if num_blocks < 1:
            raise ConfigError([f"{group}.num_blocks must be >= 1, got {num_blocks}"])
        return num_blocks
    budget = memory_bytes if memory_bytes is not None else context.memory_budget_bytes
    if budget is None:
        raise ConfigError([f"{group}.memory_bytes is unset and the executor knows no memory budget: set it"])
    block_bytes = context.spec.block_bytes(block_size, groups)
    blocks = budget // block_bytes
    if blocks < 1:
        source = f"{group}.memory_bytes={budget}" if memory_bytes is not None else f"the KV memory left ({budget} bytes)"
        raise ConfigError([f"{source} holds no block of {block_size} tokens ({block_bytes} bytes each)"])
    return blocks
