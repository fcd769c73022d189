"""``cache.lower_tier``: the tier below the host tier as the paged cache drives it."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from servelab.core.kv_tier import KVTier, TierEntry
from servelab.plugins.cache.tier_index import TierIndex

log = logging.getLogger(__name__)

BlockReader = Callable[[int], torch.Tensor]
"""A host block's content in every layer, as one uint8 tensor (a copy)."""
BlockWriter = Callable[[int, torch.Tensor], None]
"""Write one uint8 tensor of a block's content into a host block."""


class LowerTier:
    """A ``KVTier`` with its index and I/O.

    The cache records, while scheduling, the blocks the host tier evicts (``spill``:
    saved below) and the prefix hits below the host tier (``fill``: loaded into a staging
    host block). The executor hands both to ``transfer`` with the step: spilled blocks are
    copied out of the host pool at once (an offload of the same step may reuse their host
    blocks), then saves and loads run on one background thread while the step computes.
    ``finished_fills`` (the next scheduling) waits for the loads and says which succeeded;
    a request whose prefix was being loaded is admitted then, from the host tier.
    ``on_forgotten`` (None: nothing) hears each entry the tier gives up.
    """

    def __init__(self, tier: KVTier):
        self.tier = tier
        self.index: TierIndex[int] = TierIndex(tier.context.capacity_blocks)
        for entry in tier.stored()[-self.index.capacity:]:
            self.index.store(entry.digest, entry.parent, entry.tokens, entry.digest)
        self.index.stored_blocks = 0
        self.warm_blocks = len(self.index)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="servelab-kv-tier")
        self.spills: list[tuple[int, TierEntry]] = []
        self.fills: list[tuple[TierEntry, int]] = []
        self._running: list[tuple[TierEntry, int, Future | None]] = []
        self.failed_loads = 0
        self.on_forgotten: Callable[[TierEntry], None] | None = None

    # -- scheduling ---------------------------------------------------------------------------
    def spill(self, host_block: int, entry: TierEntry) -> bool:
        """Keep an entry the host tier evicted (its content still in ``host_block`` until
        this step's moves run), forgetting the least recently used when full; False when
        every entry is pinned and it is not kept."""
        index = self.index
        if entry.digest in index:
            index.touch(entry.digest)
            return True
        if index.full:
            evicted = index.evict()
            if evicted is None:
                return False
            self._io.submit(self.tier.discard, evicted[0])
            self._forgotten(evicted[1])
        index.store(entry.digest, entry.parent, entry.tokens, entry.digest)
        self.spills.append((host_block, entry))
        return True

    def _forgotten(self, entry: TierEntry) -> None:
        if self.on_forgotten is not None:
            self.on_forgotten(entry)

    def fill(self, entry: TierEntry, host_block: int) -> None:
        """Load ``entry`` into ``host_block`` with this step."""
        self.fills.append((entry, host_block))
        self.index.hit_tokens += len(entry.tokens)

    def take_moves(self) -> tuple[tuple[tuple[int, TierEntry], ...], tuple[tuple[TierEntry, int], ...]]:
        """The spills and fills recorded since the last call, for the step being scheduled."""
        moves = tuple(self.spills), tuple(self.fills)
        self.spills, self.fills = [], []
        self.index.unpin_all()
        return moves

    def finished_fills(self) -> list[tuple[TierEntry, int, bool]]:
        """The fills handed to ``transfer`` since the last call, each with whether its
        content arrived (waiting for the loads still running)."""
        running, self._running = self._running, []
        done = []
        for entry, host_block, future in running:
            ok = True if future is None else future.result()
            if not ok:
                self.failed_loads += 1
                self.index.drop(entry.digest)
                self._io.submit(self.tier.discard, entry.digest)
                self._forgotten(entry)
            done.append((entry, host_block, ok))
        return done

    # -- the executor's side --------------------------------------------------------------------
    def transfer(self, spills: tuple[tuple[int, TierEntry], ...], fills: tuple[tuple[TierEntry, int], ...],
                 read: BlockReader | None, write: BlockWriter | None) -> None:
        """Run a step's spills and fills: copy each spilled host block out now, then save
        and load on the I/O thread. Without ``read`` and ``write`` (a simulated executor,
        which holds no KV) nothing moves and every fill succeeds."""
        if read is None or write is None:
            self._running += [(entry, host_block, None) for entry, host_block in fills]
            return
        for host_block, entry in spills:
            self._io.submit(self._save, entry, read(host_block))
        for entry, host_block in fills:
            self._running.append((entry, host_block, self._io.submit(self._load, entry, host_block, write)))

    def _save(self, entry: TierEntry, payload: torch.Tensor) -> None:
        if not self.tier.save(entry, payload):
            log.debug("KV tier did not keep block %x; a later hit recomputes it", entry.digest)

    def _load(self, entry: TierEntry, host_block: int, write: BlockWriter) -> bool:
        payload = torch.empty(self.tier.context.block_bytes, dtype=torch.uint8)
        if not self.tier.load(entry, payload):
            return False
        write(host_block, payload)
        return True

    def close(self) -> None:
        """Finish every save, then close the tier."""
        self.finished_fills()
        self._io.shutdown(wait=True)
        self.tier.close()
