"""``kv_transfer=shared_memory``: instances on one host hand KV blocks over through files in
a memory-backed folder (``/dev/shm``: the copy never touches a disk).

A transfer is one file, ``servelab-kv-<sender pid>-<id>.bin``: every layer's keys then
values of the request's blocks, written under a temporary name and renamed, so a receiver
sees a whole transfer or none. The receiver copies it into its own blocks and deletes it;
an abort deletes it from either side. Data already published stays readable after its
sender stops (a prefill instance that stops after sending can still hand its requests
over) until a connector is built or shut down: those delete the files of senders that no
longer run, so nothing is left behind.
"""

from __future__ import annotations

import itertools
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.kv_transfer import (HandOff, KVTransfer, KVTransferContext, KVTransferError, TransferTicket,
                                       check_receivable, gather_blocks, scatter_blocks)

PREFIX = "servelab-kv-"


@dataclass
class SharedMemoryTransferConfig:
    """``kv_transfer=shared_memory``: ``directory`` holds the transfers (a memory-backed
    file system shared by the instances)."""

    directory: str = "/dev/shm"


def process_alive(pid: int) -> bool:
    """True while process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedMemoryTransfer(KVTransfer):
    """Transfers as whole files in ``config.directory``; see the module docstring."""

    name = "shared_memory"

    def __init__(self, config: SharedMemoryTransferConfig, context: KVTransferContext):
        self.config = config
        self.context = context
        self.directory = Path(config.directory)
        if not self.directory.is_dir() or not os.access(self.directory, os.W_OK | os.X_OK):
            raise ConfigError([f"kv_transfer.directory={config.directory!r} must be a writable folder "
                               f"(a memory-backed one such as /dev/shm)"])
        self._ids = itertools.count()
        self._token = uuid.uuid4().hex[:12]
        self._sent: dict[str, Path] = {}
        self._remove_orphans()

    def send(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], handoff: HandOff) -> TransferTicket:
        """Write the blocks of every layer into one file, atomically."""
        transfer_id = f"{self.context.instance_id}-{self._token}-{next(self._ids)}"
        path = self.directory / f"{PREFIX}{os.getpid()}-{transfer_id}.bin"
        partial = path.with_suffix(".partial")
        with open(partial, "wb") as file:
            for cache in kv_caches:
                file.write(memoryview(gather_blocks(cache, block_ids).cpu().numpy()))
        os.rename(partial, path)
        self._sent[transfer_id] = path
        first = kv_caches[0]
        return TransferTicket(transfer_id, self.name, str(path), os.getpid(), len(kv_caches), len(block_ids),
                              tuple(first.shape[1:]), first.dtype, handoff)

    def receive(self, ticket: TransferTicket, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> HandOff:
        """Copy the file into the blocks, then delete it."""
        check_receivable(ticket, kv_caches, block_ids)
        path = Path(ticket.address)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            why = ("it was aborted or already received" if process_alive(ticket.sender)
                   else f"its sender (process {ticket.sender}) is gone and its data with it")
            raise KVTransferError(ticket.transfer_id, why) from None
        if len(data) != ticket.num_bytes:
            path.unlink(missing_ok=True)
            raise KVTransferError(ticket.transfer_id, f"holds {len(data)} bytes, {ticket.num_bytes} expected")
        if data:  # a transfer of no blocks (a sequence that already stopped) has nothing to copy
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            per_layer = flat.numel() // ticket.num_layers
            for layer, cache in enumerate(kv_caches):
                scatter_blocks(cache, block_ids, flat[layer * per_layer:(layer + 1) * per_layer])
        path.unlink(missing_ok=True)
        self._sent.pop(ticket.transfer_id, None)
        return ticket.handoff

    def abort(self, ticket: TransferTicket) -> None:
        """Delete the transfer's file."""
        Path(ticket.address).unlink(missing_ok=True)
        self._sent.pop(ticket.transfer_id, None)

    @property
    def num_in_flight(self) -> int:
        """Files this connector wrote that no receiver took and no one aborted."""
        self._sent = {tid: path for tid, path in self._sent.items() if path.exists()}
        return len(self._sent)

    def shutdown(self) -> None:
        """Delete every file this connector wrote that was not handed over."""
        for path in self._sent.values():
            path.unlink(missing_ok=True)
        self._sent.clear()
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Delete the transfers (and half-written files) of senders that no longer run."""
        for path in self.directory.glob(f"{PREFIX}*"):
            pid = path.name[len(PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not process_alive(int(pid)):
                path.unlink(missing_ok=True)


SPEC = ComponentSpec("kv_transfer", "shared_memory", SharedMemoryTransfer, SharedMemoryTransferConfig,
                     "instances on one host exchange KV blocks through memory-backed files")
