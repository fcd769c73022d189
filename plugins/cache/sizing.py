"""How many blocks a cache gets from its config."""

from __future__ import annotations

from servelab.core.errors import ConfigError
from servelab.core.kv_cache import KVCacheSpec


def num_blocks_for(num_blocks: int | None, memory_bytes: int, block_size: int, spec: KVCacheSpec,
                   group: str = "cache") -> int:
    """``num_blocks`` when set, else as many blocks of ``block_size`` tokens as fit ``memory_bytes``."""
    if block_size < 1:
        raise ConfigError([f"{group}.block_size must be >= 1, got {block_size}"])
    if num_blocks is not None:
        if num_blocks < 1:
            raise ConfigError([f"{group}.num_blocks must be >= 1, got {num_blocks}"])
        return num_blocks
    blocks = memory_bytes // (spec.bytes_per_token * block_size)
    if blocks < 1:
        raise ConfigError([f"{group}.memory_bytes={memory_bytes} holds no block of {block_size} tokens "
                           f"({spec.bytes_per_token * block_size} bytes each)"])
    return blocks
