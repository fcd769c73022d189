"""``kv_transfer=torch_distributed``: instances hand KV blocks over with torch.distributed
send and recv (gloo, or NCCL between GPUs), on one host or on several.

Every connector of a deployment joins one ``torch.distributed.TCPStore`` at
``host:port``, its control plane: the first connector started on the machine ``host``
names serves it (listening on every interface), the others connect to it. ``send`` keeps
the request's gathered blocks in this process (CPU memory for gloo, GPU memory for NCCL)
until a receiver takes them or someone aborts; the ticket's address is the sender's key
in the store and its host. ``receive`` pulls: it puts a request in the sender's inbox (a
store queue that a daemon thread of each connector answers, in order), the sender answers
whether it holds the transfer and how it moves, then both ends open (or reuse) a two-rank
process group of their pair through a prefix of the store, sender rank 0, and the sender
sends each layer's bytes as one uint8 tensor. The blocks are written only once every byte
arrived. A receiver in the sender's process copies directly. An abort from the receiving
side is a message in the same inbox, so a pull that comes after it finds nothing.

A receiver never waits longer than ``timeout_s`` for a sender: it fails at once when the
sender shut down, or runs on this host and its process is gone. Data lives in its
sender's process: it goes when that process stops, and the store with the process that
serves it, so that instance must outlive the others.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.kv_transfer import (HandOff, KVTransfer, KVTransferContext, KVTransferError, TransferTicket,
                                       check_receivable, gather_blocks, scatter_blocks)
from servelab.plugins.kv_transfer.shared_memory import process_alive

log = logging.getLogger(__name__)

BACKENDS = ("auto", "gloo", "nccl")
ROOT = "servelab-kv"
IDLE_WAIT = timedelta(hours=1)  # how long the serving thread waits on an empty inbox before looking again
MAX_POLL_S = 0.01  # the longest pause between two looks at a sender's answer
GONE = "it was aborted or already received"

_local: dict[str, "TorchDistributedTransfer"] = {}
"""The connectors of this process that run, by key: a receiver copies from them directly."""
_local_lock = threading.Lock()


@dataclass
class TorchDistributedTransferConfig:
    """``kv_transfer=torch_distributed``, the same for every instance of a deployment:
    ``host`` and ``port`` of the TCPStore they all join (served by the first instance
    started on the machine ``host`` names); ``backend`` that moves the blocks (``gloo``,
    ``nccl``, or ``auto``: NCCL when both ends' caches are on CUDA, else gloo);
    ``timeout_s`` bounds every wait (joining the store, a sender's answer, a transfer)."""

    host: str = "127.0.0.1"
    port: int = 29650
    backend: str = "auto"
    timeout_s: float = 30.0


def config_problems(config: TorchDistributedTransferConfig) -> list[str]:
    """Every reason ``config`` cannot work, each naming its setting and the limit."""
    problems = []
    if config.backend not in BACKENDS:
        problems.append(f"kv_transfer.backend={config.backend!r} must be one of {', '.join(BACKENDS)}")
    elif config.backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        problems.append("kv_transfer.backend='nccl' needs a CUDA device and a torch built with NCCL; "
                        "use gloo or auto")
    if not config.host:
        problems.append("kv_transfer.host must name the machine that serves the store")
    if not 1 <= config.port <= 65535:
        problems.append(f"kv_transfer.port={config.port} must be in [1, 65535]")
    if not config.timeout_s > 0:
        problems.append(f"kv_transfer.timeout_s={config.timeout_s} must be > 0")
    return problems


def is_this_machine(host: str) -> bool:
    """True when ``host`` is an address of this machine (a socket can bind it)."""
    try:
        addresses = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, address in addresses:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as probe:
            probe.bind(address)
            return True
    return False


def join_store(config: TorchDistributedTransferConfig) -> dist.TCPStore:
    """The deployment's store: served from this process when ``host`` is this machine and
    the port is free or already served here, else joined; ``ConfigError`` naming
    ``kv_transfer.host`` and ``kv_transfer.port`` when none answers in time."""
    timeout = timedelta(seconds=config.timeout_s)
    if is_this_machine(config.host):
        with contextlib.suppress(dist.DistError):  # another process serves the port: join it
            return dist.TCPStore(config.host, config.port, None, True, timeout, wait_for_workers=False,
                                 multi_tenant=True)
    try:
        return dist.TCPStore(config.host, config.port, None, False, timeout)
    except dist.DistError as exc:
        raise ConfigError([f"kv_transfer.host={config.host!r}, kv_transfer.port={config.port}: no TCPStore "
                           f"answered within kv_transfer.timeout_s={config.timeout_s} ({exc}); start an instance "
                           f"on that machine, or point both settings at it"]) from None


@contextlib.contextmanager
def hosted_store(config: TorchDistributedTransferConfig) -> Iterator[None]:
    """The store of ``config`` served from this process for the ``with`` block, when
    ``host`` is this machine (elsewhere an instance on that machine serves it)."""
    problems = config_problems(config)
    if problems:
        raise ConfigError(problems)
    store = join_store(config) if is_this_machine(config.host) else None
    try:
        yield
    finally:
        del store


def host_identity() -> str:
    """This machine and process namespace: a ticket's sender pid is checked only where its
    address carries the same identity."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc (not Linux): the host name alone
        namespace = ""
    return socket.gethostname() + namespace


def new_group(backend: str, store: dist.Store, rank: int, timeout: timedelta) -> Any:
    """A two-rank process group of ``backend`` over ``store``; both ranks must open it."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def on_device(tensor: torch.Tensor) -> Any:
    """The context that makes ``tensor``'s GPU the current one (none for CPU tensors)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


class PairGroups:
    """One end's two-rank process groups, one per peer and backend, each named by a key the
    sender makes of both ends' failure counts: after an error at either end the pair opens
    a new group (a failed gloo group cannot be used again). Used by one thread."""

    def __init__(self, rank: int, timeout: timedelta):
        self.rank = rank
        self.timeout = timeout
        self.failures: dict[str, int] = {}  # peer key -> groups with it that failed at this end
        self._groups: dict[tuple[str, str], tuple[str, Any]] = {}  # (peer, backend) -> (key, group)

    def get(self, peer: str, backend: str, key: str, store: dist.Store) -> Any:
        """The pair's group ``key``, opened over a prefix of ``store`` on first use (with the
        peer, which opens it too); a group of an older key with that peer is closed."""
        cached = self._groups.pop((peer, backend), None)
        if cached is not None and cached[0] == key:
            self._groups[peer, backend] = cached
            return cached[1]
        if cached is not None:
            cached[1].shutdown()
        group = new_group(backend, dist.PrefixStore(key + "/", store), self.rank, self.timeout)
        self._groups[peer, backend] = (key, group)
        return group

    def failed(self, peer: str, backend: str) -> None:
        """Close the pair's group after an error; its next transfer opens a new one."""
        self.failures[peer] = self.failures.get(peer, 0) + 1
        cached = self._groups.pop((peer, backend), None)
        if cached is not None:
            cached[1].shutdown()

    def close(self) -> None:
        """Close every group."""
        for _, group in self._groups.values():
            group.shutdown()
        self._groups.clear()


class TorchDistributedTransfer(KVTransfer):
    """Transfers pulled over torch.distributed process groups; see the module docstring."""

    name = "torch_distributed"

    def __init__(self, config: TorchDistributedTransferConfig, context: KVTransferContext):
        problems = config_problems(config)
        if problems:
            raise ConfigError(problems)
        self.config = config
        self.context = context
        self.timeout = timedelta(seconds=config.timeout_s)
        self.token = uuid.uuid4().hex[:12]
        self.key = f"{ROOT}/{context.instance_id}/{self.token}"
        self.host = host_identity()
        self._store = join_store(config)
        self._ids, self._requests = itertools.count(), itertools.count()
        self._held: dict[str, list[torch.Tensor]] = {}
        self._lock, self._receiving = threading.Lock(), threading.Lock()
        self._senders = PairGroups(1, self.timeout)  # the groups this end receives over (the callers')
        self._receivers = PairGroups(0, self.timeout)  # the groups it sends over (the serving thread's)
        with _local_lock:
            _local[self.key] = self
        serving_store = self._store.clone()  # the serving thread's own connection: it blocks on the inbox
        serving_store.set_timeout(IDLE_WAIT)
        self._thread = threading.Thread(target=self._serve, args=(serving_store,), daemon=True,
                                        name=f"kv-transfer-{context.instance_id}")
        self._thread.start()

    def _nccl(self, device: torch.device) -> bool:
        """True when this end moves the blocks of a cache on ``device`` with NCCL."""
        return self.config.backend == "nccl" or (
            self.config.backend == "auto" and device.type == "cuda" and dist.is_nccl_available())

    def send(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], handoff: HandOff) -> TransferTicket:
        """Gather the blocks of every layer and hold them here until a receiver pulls them."""
        first = kv_caches[0]
        transfer_id = f"{self.context.instance_id}-{self.token}-{next(self._ids)}"
        holder = torch.device("cpu")
        if self._nccl(first.device):
            holder = first.device if first.is_cuda else torch.device("cuda", torch.cuda.current_device())
        layers = [gather_blocks(cache, block_ids).to(holder) for cache in kv_caches]
        if holder.type == "cuda":  # the serving thread sends them from its own stream
            torch.cuda.current_stream(holder).synchronize()
        with self._lock:
            self._held[transfer_id] = layers
        return TransferTicket(transfer_id, self.name, f"{self.key}@{self.host}", os.getpid(), len(kv_caches),
                              len(block_ids), tuple(first.shape[1:]), first.dtype, handoff)

    def receive(self, ticket: TransferTicket, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> HandOff:
        """Copy the ticket's blocks in: straight from a sender in this process, else pulled
        from it over torch.distributed; the sender then drops them."""
        check_receivable(ticket, kv_caches, block_ids)
        sender_key = ticket.address.rpartition("@")[0]
        with _local_lock:
            sender = _local.get(sender_key)
        if sender is None:
            layers = self._pull(ticket, sender_key, kv_caches[0].device)
        else:
            layers = sender._take(ticket.transfer_id)
            if layers is None:
                raise KVTransferError(ticket.transfer_id, GONE)
        if ticket.num_bytes:
            for cache, data in zip(kv_caches, layers):
                scatter_blocks(cache, block_ids, data)
        return ticket.handoff

    def abort(self, ticket: TransferTicket) -> None:
        """Drop the transfer: here when a connector of this process sent it, else through a
        message to its sender (which no longer holds it once it reads the message)."""
        sender_key = ticket.address.rpartition("@")[0]
        with _local_lock:
            sender = _local.get(sender_key)
        if sender is not None:
            sender._take(ticket.transfer_id)
            return
        if self._store is None:
            log.warning("kv_transfer=torch_distributed %s: shut down, cannot abort %r of another process",
                        self.context.instance_id, ticket.transfer_id)
            return
        try:
            if not self._store.check([f"{sender_key}/closed"]):
                self._store.queue_push(f"{sender_key}/inbox", json.dumps({"op": "abort", "id": ticket.transfer_id}))
        except dist.DistError as exc:
            log.warning("kv_transfer=torch_distributed: cannot reach the store at %s:%d to abort %r: %s",
                        self.config.host, self.config.port, ticket.transfer_id, exc)

    @property
    def num_in_flight(self) -> int:
        """Transfers this connector holds: sent, neither taken nor aborted."""
        with self._lock:
            return len(self._held)

    def shutdown(self) -> None:
        """Drop what was not handed over, tell receivers this sender is gone, stop the serving
        thread, close the process groups and leave the store. Harmless when done."""
        if self._store is None:
            return
        with _local_lock:
            _local.pop(self.key, None)
        with self._lock:
            self._held.clear()
        try:
            self._store.set(f"{self.key}/closed", "1")
            self._store.queue_push(f"{self.key}/inbox", json.dumps({"op": "stop"}))
        except dist.DistError:  # the store is gone: so is the thread's connection, it stops by itself
            pass
        self._thread.join(self.config.timeout_s)
        self._senders.close()
        self._receivers.close()
        self._store = None  # the last connector of the process serving the store closes it

    @classmethod
    def host_deployment(cls, config: TorchDistributedTransferConfig) -> contextlib.AbstractContextManager:
        """Serve the deployment's store from the process that starts its instances (when
        ``host`` is this machine), so that it outlives every instance and each can leave
        it at shutdown in any order."""
        return hosted_store(config)

    def _take(self, transfer_id: str) -> list[torch.Tensor] | None:
        """Stop holding a transfer; its bytes per layer, None when it is not held."""
        with self._lock:
            return self._held.pop(transfer_id, None)

    def _pull(self, ticket: TransferTicket, sender_key: str, device: torch.device) -> list[torch.Tensor]:
        """Ask the ticket's sender for its blocks and receive each layer's bytes."""
        if self._store is None:
            raise KVTransferError(ticket.transfer_id, "this receiving connector has been shut down")
        with self._receiving:
            try:
                answer = self._ask(ticket, sender_key, device)
            except dist.DistError as exc:
                raise KVTransferError(ticket.transfer_id, f"lost the store at kv_transfer.host={self.config.host!r}"
                                      f", kv_transfer.port={self.config.port}: {exc}") from None
            if "error" in answer:
                raise KVTransferError(ticket.transfer_id, answer["error"])
            if not ticket.num_bytes:
                return []
            backend = answer["backend"]
            buffer_device = torch.device("cpu")
            if backend == "nccl":
                buffer_device = device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
            buffers = [torch.empty(ticket.num_bytes // ticket.num_layers, dtype=torch.uint8, device=buffer_device)
                       for _ in range(ticket.num_layers)]
            try:
                group = self._senders.get(sender_key, backend, answer["group"], self._store)
                with on_device(buffers[0]):
                    for work in [group.recv([buffer], 0, layer) for layer, buffer in enumerate(buffers)]:
                        work.wait(self.timeout)
            except RuntimeError as exc:
                self._senders.failed(sender_key, backend)
                reason = f"receiving its blocks over {backend} failed: {exc}"
                raise KVTransferError(ticket.transfer_id, reason) from None
            return buffers

    def _sender_gone(self, ticket: TransferTicket, sender_key: str) -> str | None:
        """Why the ticket's sender can no longer answer (None while it may)."""
        if ticket.address.rpartition("@")[2] == self.host and not process_alive(ticket.sender):
            return f"its sender (process {ticket.sender}) is gone and its data with it"
        if self._store.check([f"{sender_key}/closed"]):
            return "its sender has shut down and dropped its data"
        return None

    def _ask(self, ticket: TransferTicket, sender_key: str, device: torch.device) -> dict:
        """Put a pull in the sender's inbox and wait for its answer (at most ``timeout_s``):
        ``{"error": reason}`` or how the blocks move, ``{"backend", "group"}``."""
        gone = self._sender_gone(ticket, sender_key)
        if gone is not None:
            raise KVTransferError(ticket.transfer_id, gone)
        reply = f"{sender_key}/reply/{self.key}/{next(self._requests)}"
        self._store.queue_push(f"{sender_key}/inbox", json.dumps({
            "op": "pull", "id": ticket.transfer_id, "reply": reply, "receiver": self.key,
            "failures": self._senders.failures.get(sender_key, 0), "nccl": self._nccl(device)}))
        deadline, pause = time.monotonic() + self.config.timeout_s, 1e-4
        while not self._store.check([reply]):
            gone = self._sender_gone(ticket, sender_key)
            if gone is None and time.monotonic() > deadline:
                gone = f"its sender did not answer within kv_transfer.timeout_s={self.config.timeout_s}"
            if gone is not None:
                raise KVTransferError(ticket.transfer_id, gone)
            time.sleep(pause)
            pause = min(2 * pause, MAX_POLL_S)
        answer = json.loads(self._store.get(reply))
        self._store.delete_key(reply)
        return answer

    def _serve(self, store: dist.TCPStore) -> None:
        """The serving thread, on its own connection ``store``: answer the inbox's pulls and
        aborts in order until stopped."""
        inbox = f"{self.key}/inbox"
        while True:
            try:
                message = json.loads(store.queue_pop(inbox, True))
                if message["op"] == "stop":
                    return
                if message["op"] == "abort":
                    self._take(message["id"])
                else:
                    self._answer(message, store)
            except dist.DistStoreError:  # an idle inbox for IDLE_WAIT: look again
                continue
            except dist.DistError as exc:
                log.warning("kv_transfer=torch_distributed %s: lost the store at %s:%d, serving no more "
                            "transfers: %s", self.context.instance_id, self.config.host, self.config.port, exc)
                return

    def _answer(self, message: dict, store: dist.TCPStore) -> None:
        """Serve one pull: tell the receiver whether the transfer is here and how it moves,
        then send its bytes and drop it (kept, for another try, when the send fails)."""
        with self._lock:
            layers = self._held.get(message["id"])
        if layers is None:
            store.set(message["reply"], json.dumps({"error": GONE}))
            return
        receiver = message["receiver"]
        backend = "nccl" if message["nccl"] and layers and layers[0].is_cuda else "gloo"
        generation = f"{self._receivers.failures.get(receiver, 0)}.{message['failures']}"
        key = f"{ROOT}/group/{self.key}>{receiver}>{backend}#{generation}"
        store.set(message["reply"], json.dumps({"backend": backend, "group": key}))
        if any(layer.numel() for layer in layers):
            try:
                group = self._receivers.get(receiver, backend, key, store)
                with on_device(layers[0]):
                    sends = [group.send([data if backend == "nccl" else data.cpu()], 1, layer)
                             for layer, data in enumerate(layers)]
                    for work in sends:
                        work.wait(self.timeout)
            except RuntimeError as exc:
                self._receivers.failed(receiver, backend)
                log.warning("kv_transfer=torch_distributed %s: sending %r to %s failed, it stays receivable: %s",
                            self.context.instance_id, message["id"], receiver, exc)
                return
        self._take(message["id"])


SPEC = ComponentSpec("kv_transfer", "torch_distributed", TorchDistributedTransfer, TorchDistributedTransferConfig,
                     "instances on one host or several pull KV blocks over torch.distributed (gloo or NCCL)")
