"""A pool of fixed-size cache blocks with reference counts."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out block ids; a block is free again when its last holder releases it."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks not held by anyone (and not kept for prefix reuse)."""
        return len(self._free)

    def take(self, count: int) -> list[int] | None:
        """``count`` fresh blocks (reference count 1), or None when fewer are free."""
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add one holder to each block."""
        for block in blocks:
            self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> list[int]:
        """Drop one holder from each block; returns the blocks nobody holds any more.
        They are not free yet: the caller keeps them (prefix cache) or ``put_free``s them."""
        unheld = []
        for block in blocks:
            count = self.ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"block {block} released more often than taken")
            self.ref_counts[block] = count
            if count == 0:
                unheld.append(block)
        return unheld

    def put_free(self, blocks: list[int]) -> None:
        """Return unheld blocks to the free list."""
        self._free.extend(blocks)
