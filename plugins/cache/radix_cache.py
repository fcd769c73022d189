"""``cache.prefix_index=radix``: the prefix cache as a tree of blocks, matched token by token."""

from __future__ import annotations

from typing import Callable, Sequence

from servelab.plugins.cache.prefix_cache import PrefixCache


class RadixPrefixCache(PrefixCache):
    """The hashed prefix cache with each block linked under its parent, a radix tree whose
    edges are blocks of ``block_size`` tokens (as SGLang's RadixAttention, in pages).

    Full blocks match as in the hashed cache; past the last full block, ``partial`` finds
    the child block that shares the most leading tokens with what follows, so a prompt
    that diverges from a cached one inside a block still reuses the tokens before the
    divergence (the paged cache copies that block and computes only the rest).
    """

    def __init__(self, block_size: int, eviction):
        super().__init__(block_size, eviction)
        self._children: dict[tuple[int, int | None], dict[int, None]] = {}
        self.partial_hit_tokens = 0

    def register(self, block: int, parent: int | None, tokens: tuple[int, ...], group: int = 0) -> int:
        """Record a just-filled block under its parent."""
        digest = super().register(block, parent, tokens, group)
        if self._entry.get(block, (None, None))[1] == digest:
            self._children.setdefault((group, parent), {})[block] = None
        return digest

    def _forget(self, block: int, kind: str = "evicted") -> tuple[int, int]:
        group, digest, parent = self._entry[block][:3]
        siblings = self._children[group, parent]
        del siblings[block]
        if not siblings:
            del self._children[group, parent]
        return super()._forget(block, kind)

    def partial(self, token_ids: Sequence[int], parent: int | None, max_tokens: int,
                usable: Callable[[int], bool], group: int = 0) -> tuple[int | None, int]:
        """The ``usable`` cached block under ``parent`` (None: a first block) whose tokens
        share the longest run with the start of ``token_ids``, at most ``max_tokens`` and
        fewer than a block: (block, tokens shared), or (None, 0)."""
        best, best_length = None, 0
        wanted = token_ids[:min(max_tokens, self.block_size - 1)]
        for block in self._children.get((group, parent), ()):
            if not usable(block):
                continue
            tokens = self._entry[block][3]
            length = 0
            for mine, theirs in zip(wanted, tokens):
                if mine != theirs:
                    break
                length += 1
            if length > best_length:
                best, best_length = block, length
        return best, best_length

    @property
    def tree_size(self) -> int:
        """Cached blocks in the tree (nodes below the root)."""
        return len(self._entry)
