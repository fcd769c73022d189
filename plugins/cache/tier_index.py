"""The index of a KV tier below the device: which cached blocks it holds, least recently used first."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

from servelab.core.kv_tier import TierEntry

Slot = TypeVar("Slot", bound=Hashable)


class TierIndex(Generic[Slot]):
    """Cached full blocks of one tier, each keyed by its chained hash with its parent hash
    and tokens (a lookup checks the content as the device's prefix cache does) and the
    ``Slot`` holding it (the host tier: a host block of the cache's host pool, the one
    swapping uses; a lower tier: the digest itself), least recently used first.

    A slot found for the step being scheduled is pinned until that step's moves are taken;
    pinned entries are never evicted (an offload of the same step would overwrite them
    first). ``stored_blocks`` counts entries added, ``hit_tokens`` the tokens found.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[int, tuple[Slot, int | None, tuple[int, ...]]] = OrderedDict()
        self._pinned: set[Slot] = set()
        self.stored_blocks = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: int) -> bool:
        return digest in self._entries

    def holds(self, digest: int, parent: int | None, tokens: tuple[int, ...]) -> bool:
        """True when ``tokens`` after the block hashed ``parent`` are here (nothing changes)."""
        entry = self._entries.get(digest)
        return entry is not None and entry[1:] == (parent, tokens)

    def find(self, digest: int, parent: int | None, tokens: tuple[int, ...]) -> Slot | None:
        """The slot holding ``tokens`` after the block hashed ``parent`` (refreshed as
        most recently used and pinned for this step), or None."""
        if not self.holds(digest, parent, tokens):
            return None
        self._entries.move_to_end(digest)
        slot = self._entries[digest][0]
        self._pinned.add(slot)
        return slot

    def pin(self, slot: Slot) -> None:
        """Keep ``slot``'s entry until this step's moves are taken (written by this step)."""
        self._pinned.add(slot)

    def touch(self, digest: int) -> None:
        """Mark an entry as most recently used."""
        self._entries.move_to_end(digest)

    def store(self, digest: int, parent: int | None, tokens: tuple[int, ...], slot: Slot) -> None:
        """Keep a block's content in ``slot``."""
        self._entries[digest] = (slot, parent, tokens)
        self.stored_blocks += 1

    @property
    def full(self) -> bool:
        """True when the tier holds as many blocks as its budget allows."""
        return len(self._entries) >= self.capacity

    def evict(self) -> tuple[Slot, TierEntry] | None:
        """Forget the least recently used entry not pinned: (its slot, what it held), or
        None when every entry is pinned."""
        for digest, (slot, parent, tokens) in self._entries.items():
            if slot not in self._pinned:
                del self._entries[digest]
                return slot, TierEntry(digest, parent, tokens)
        return None

    def drop(self, digest: int) -> Slot | None:
        """Forget ``digest``'s entry (a load of it failed); its slot, or None."""
        entry = self._entries.pop(digest, None)
        return None if entry is None else entry[0]

    def unpin_all(self) -> None:
        """The step's loads were handed out: nothing is pinned any more."""
        self._pinned.clear()

    def clear(self) -> list[Slot]:
        """Forget every entry; their slots."""
        slots = [slot for slot, _, _ in self._entries.values()]
        self._entries.clear()
        self._pinned.clear()
        return slots
