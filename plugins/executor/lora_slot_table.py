"""Which LoRA adapter is in which slot: the paging policy of the adapter slots, apart from
their tensors, so the model executor (``lora_slots.py``) and the simulated one
(``simulated_lora.py``) page adapters alike.

A step's adapters are paged into free slots, then over the least recently used adapters
the step does not need; a step that needs more adapters than there are slots runs as
several forward passes (``chunks``). Subclasses write an adapter into a slot (``load``)
and say how long that took.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from servelab.core.lora_adapter import LoRAAdapter
from servelab.core.scheduler import ScheduledRequest


@dataclass(frozen=True, slots=True)
class LoRAStats:
    """Adapter paging so far: ``slots`` on the device, ``resident`` adapters in them,
    ``hits`` (a step's adapter already in a slot), ``misses`` (paged in), ``evictions``,
    ``load_seconds`` spent paging in, ``split_steps`` (steps run as several passes)."""

    slots: int
    resident: int
    hits: int
    misses: int
    evictions: int
    load_seconds: float
    split_steps: int

    @property
    def hit_rate(self) -> float:
        """Hits over every adapter use by a step (0 before any)."""
        uses = self.hits + self.misses
        return self.hits / uses if uses else 0.0


class LoRASlotTable(abc.ABC):
    """``num_slots`` adapter slots paged least recently used first (module docstring)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.resident: OrderedDict[int, int] = OrderedDict()  # load id -> slot, least recently used first
        self.hits = self.misses = self.evictions = self.split_steps = 0
        self.load_seconds = 0.0

    @abc.abstractmethod
    def load(self, load_id: int, adapter: LoRAAdapter, slot: int) -> float:
        """Write ``adapter`` into ``slot`` (over what was there); the seconds it took."""

    @property
    def stats(self) -> LoRAStats:
        """Paging counters so far."""
        return LoRAStats(self.num_slots, len(self.resident), self.hits, self.misses, self.evictions,
                         self.load_seconds, self.split_steps)

    def page_in(self, adapters: dict[int, LoRAAdapter]) -> dict[int, int]:
        """Slots for ``adapters`` (by load id, at most ``num_slots``), paging in the missing
        ones over free slots, then over the least recently used adapters not needed."""
        for load_id in adapters:
            if load_id in self.resident:
                self.resident.move_to_end(load_id)
                self.hits += 1
        taken = set(self.resident.values())
        free = [slot for slot in range(self.num_slots) if slot not in taken]
        for load_id, adapter in adapters.items():
            if load_id in self.resident:
                continue
            if free:
                slot = free.pop()
            else:
                victim = next(old for old in self.resident if old not in adapters)
                slot = self.resident.pop(victim)
                self.evictions += 1
            self.load_seconds += self.load(load_id, adapter, slot)
            self.resident[load_id] = slot
            self.misses += 1
        return {load_id: self.resident[load_id] for load_id in adapters}

    def chunks(self, grants: Sequence[ScheduledRequest]) -> list[list[int]]:
        """The grants (by index, each list in the step's order) of each forward pass: the
        adapters in first-use order, the resident ones first, ``num_slots`` per pass; the
        base model's grants ride with the first."""
        order: dict[int, list[int]] = {}
        for index, grant in enumerate(grants):
            adapter = grant.request.lora
            order.setdefault(-1 if adapter is None else adapter.load_id, []).append(index)
        base = order.pop(-1, [])
        adapters = sorted(order, key=lambda load_id: load_id not in self.resident)
        passes = [adapters[i:i + self.num_slots] for i in range(0, len(adapters), self.num_slots)] or [[]]
        return [sorted(base + [i for load_id in group for i in order[load_id]]) if first else
                sorted(i for load_id in group for i in order[load_id]) for first, group in
                zip([True] + [False] * (len(passes) - 1), passes)]
