"""LoRA adapter slots under tensor and pipeline parallelism: the driver (rank 0) decides
what each slot holds (``LoRASlots``) and every worker rank mirrors it on its share of the
model (its rows or columns, its pipeline stage's layers).

Three messages, each an int64 header and payload like the step's (``distributed.py``):
``LORA_LOAD`` (read the adapter from the adapter store, its name and source's bytes in
the payload, and keep this rank's share of it under its load id), ``LORA_FORGET`` (drop
it) and ``LORA_PASS`` (the adapters paged into slots and each request's slot for the next
forward pass; the step message follows). Workers read adapters from their own store
(``lora.store``), so its source must be readable the same way on every node (a folder at
the same path for the built-in stores).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from servelab.core.lora_adapter import LoRAAdapter, adapter_from_peft
from servelab.core.lora_store import LoRAStore
from servelab.plugins.executor.distributed import HEADER_SIZE, LORA_FORGET, LORA_LOAD, LORA_PASS
from servelab.plugins.executor.lora_slots import LoRASlots


def _header(kind: int, *values: int) -> torch.Tensor:
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[:1 + len(values)] = torch.tensor([kind, *values], dtype=torch.int64)
    return header


class LoRAPeers:
    """The driver's side: every slot change goes to the workers through ``broadcast(header,
    payload)`` (the executor's non-blocking send to every worker)."""

    def __init__(self, broadcast: Callable[[torch.Tensor, torch.Tensor], None]):
        self.broadcast = broadcast

    def load(self, adapter: LoRAAdapter) -> None:
        """Every worker reads ``adapter`` from its source and keeps its share."""
        text = torch.tensor(list(f"{adapter.name}\0{adapter.path}".encode()), dtype=torch.int64)
        self.broadcast(_header(LORA_LOAD, adapter.load_id, text.numel()), text)

    def forget(self, load_id: int) -> None:
        """Every worker drops adapter ``load_id``."""
        self.broadcast(_header(LORA_FORGET, load_id), torch.zeros(1, dtype=torch.int64))

    def run_pass(self, paged: list[tuple[int, int]], request_slots: np.ndarray) -> None:
        """The next forward pass: ``paged`` (load id, slot) writes first, then each
        request's slot (-1: none)."""
        payload = torch.tensor([value for pair in paged for value in pair] + request_slots.tolist(), dtype=torch.int64)
        self.broadcast(_header(LORA_PASS, len(paged), len(request_slots)), payload)


class WorkerLoRA:
    """A worker rank's side: ``LoRASlots`` over its share of ``model`` (``lora_cfg``: the
    engine config's ``lora`` node), kept as the driver's messages say, its adapters read
    from ``store``."""

    def __init__(self, model: torch.nn.Module, lora_cfg: Any, dtype: torch.dtype, device: torch.device,
                 store: LoRAStore):
        self.slots = LoRASlots(model, lora_cfg, dtype, device)
        self.store = store
        self.max_rank = lora_cfg.max_rank
        self.request_slots = np.zeros(0, dtype=np.int32)

    def receive(self, header: torch.Tensor) -> None:
        """Apply one message (its header received already; its payload follows from rank 0)."""
        kind, first, count = (int(v) for v in header[:3])
        size = {LORA_LOAD: count, LORA_FORGET: 1, LORA_PASS: 2 * first + count}[kind]
        payload = torch.empty(size, dtype=torch.int64)
        dist.recv(payload, 0)
        if kind == LORA_LOAD:
            name, _, source = bytes(payload.tolist()).decode().partition("\0")
            self.slots.check(adapter_from_peft(name, self.store.fetch(name, source), self.max_rank, first))
        elif kind == LORA_FORGET:
            self.slots.placements.pop(first, None)
        else:
            pairs, slots = payload.split([2 * first, count])
            for load_id, slot in pairs.view(-1, 2).tolist():
                self.slots.place(load_id, slot)
            self.request_slots = slots.numpy().astype(np.int32)

    def before_step(self, query_lens: tuple[int, ...]) -> None:
        """Group the coming step's tokens as the last ``LORA_PASS`` said."""
        self.slots.use_slots(self.request_slots, query_lens)
