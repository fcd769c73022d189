"""``kv_transfer=simulated``: hands a simulated engine's requests over without bytes and
prices what a real transfer would move.

Under ``executor=simulated`` an engine holds no KV tensors, only their shape:
``Executor.local_kv_caches`` returns meta tensors (every layer's blocks, no storage). For
those this connector copies nothing: its ticket records the blocks' layers, count, shape
and dtype, so ``TransferTicket.num_bytes`` is what the move costs (layers x blocks x block
bytes, any ``cache.kv_dtype``, scales included), and ``receive`` checks the receiving cache
as a real connector does. ``price`` turns those bytes into seconds over a link, which the
simulated deployment adds on its virtual clock. Caches that hold bytes (a real engine)
move through the ``data`` connector (default ``shared_memory``), so the connector keeps
the whole contract either way.
"""

from __future__ import annotations

import itertools
import os
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.kv_transfer import (HandOff, KVTransfer, KVTransferContext, KVTransferError, TransferTicket,
                                       check_receivable)

_LIVE: set[str] = set()
"""Shape-only transfers sent in this process and neither received nor aborted (a ticket
from another process has no data to lose: it is received as it comes)."""


@dataclass
class SimulatedTransferConfig:
    """``kv_transfer=simulated``: ``data``, the registered connector that moves real
    caches' bytes (the link a simulation prices is ``deployment.link``)."""

    data: str = "shared_memory"


class SimulatedTransfer(KVTransfer):
    """Shape-only tickets for meta caches, the ``data`` connector for real ones; ``price``
    gives a transfer's seconds over a link."""

    name = "simulated"
    handles_meta_caches = True
    """Read by ``LLMEngine.hand_off``: caches without storage (``executor=simulated``) may
    be handed over through this connector."""

    def __init__(self, config: SimulatedTransferConfig, context: KVTransferContext):
        self.config = config
        self.context = context
        self._ids = itertools.count()
        self._token = uuid.uuid4().hex[:12]
        self._sent: set[str] = set()
        self._data: KVTransfer | None = None
        if config.data == self.name:
            raise ConfigError([f"kv_transfer.data={config.data!r} must name another connector (one that moves "
                               f"bytes, such as shared_memory)"])
        if context.registry is not None:
            context.registry.get("kv_transfer", config.data)  # an unknown name lists the registered ones

    def price(self, ticket: TransferTicket, link: Any, streams: int = 1) -> float:
        """Seconds to move the ticket's bytes over ``streams`` links in parallel (each
        device of an instance sends its share over its own): the link's fixed
        ``latency_s`` plus the bytes at its one-way ``bandwidth``."""
        return link.latency_s + ticket.num_bytes / (link.bandwidth * streams)

    def send(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], handoff: HandOff) -> TransferTicket:
        """A shape-only ticket for meta caches; real caches go through the ``data`` connector."""
        first = kv_caches[0]
        if not first.is_meta:
            return self._data_connector().send(kv_caches, block_ids, handoff)
        transfer_id = f"{self.context.instance_id}-{self._token}-{next(self._ids)}"
        self._sent.add(transfer_id)
        _LIVE.add(transfer_id)
        return TransferTicket(transfer_id, self.name, transfer_id, os.getpid(), len(kv_caches), len(block_ids),
                              tuple(first.shape[1:]), first.dtype, handoff)

    def receive(self, ticket: TransferTicket, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> HandOff:
        """Check the receiving cache and hand the request over (a shape-only ticket, into
        meta caches only), or receive through the ``data`` connector."""
        if ticket.connector != self.name:
            return self._data_connector().receive(ticket, kv_caches, block_ids)
        if kv_caches and not kv_caches[0].is_meta:
            raise KVTransferError(ticket.transfer_id, "it carries no bytes (a simulated engine's blocks): it "
                                                      "can go only to another simulated engine")
        check_receivable(ticket, kv_caches, block_ids)
        if ticket.sender == os.getpid() and ticket.transfer_id not in _LIVE:
            raise KVTransferError(ticket.transfer_id, "it was aborted or already received")
        _LIVE.discard(ticket.transfer_id)
        self._sent.discard(ticket.transfer_id)
        return ticket.handoff

    def abort(self, ticket: TransferTicket) -> None:
        """Drop the transfer (harmless if it is done)."""
        if ticket.connector != self.name:
            self._data_connector().abort(ticket)
            return
        _LIVE.discard(ticket.transfer_id)
        self._sent.discard(ticket.transfer_id)

    @property
    def num_in_flight(self) -> int:
        """Transfers this connector sent, shape-only or real, neither received nor aborted."""
        self._sent &= _LIVE
        return len(self._sent) + (self._data.num_in_flight if self._data is not None else 0)

    def shutdown(self) -> None:
        """Drop every transfer this connector sent and nobody took."""
        _LIVE.difference_update(self._sent)
        self._sent.clear()
        if self._data is not None:
            self._data.shutdown()

    def _data_connector(self) -> KVTransfer:
        """The connector that moves real bytes, built on first use."""
        if self._data is None:
            registry = self.context.registry
            if registry is None:
                raise ConfigError([f"kv_transfer=simulated moves real caches' bytes through kv_transfer.data="
                                   f"{self.config.data}, which it builds from KVTransferContext.registry (None here)"])
            config = registry.get("kv_transfer", self.config.data).config_cls()
            self._data = registry.build("kv_transfer", config, self.context)
        return self._data


SPEC = ComponentSpec("kv_transfer", "simulated", SimulatedTransfer, SimulatedTransferConfig,
                     "simulated engines hand off without bytes, each transfer priced over a link; real caches "
                     "move through the data connector")
