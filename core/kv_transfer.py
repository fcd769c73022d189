"""The KV transfer contract: move one request's KV blocks from the instance that ran its
prefill to the instance that decodes it (disaggregated prefill and decode).

The data plane is the connector's; the control plane is the deployment's. The sender
publishes a request's blocks with ``send`` and gets a ``TransferTicket``, a small picklable
record the deployment hands to the decode instance together with the request's state
(``HandOff``: its tokens so far, the first one(s) included, its sampling parameters and
random stream). The decode instance allocates blocks when it has room, then ``receive``
copies the blocks into its own cache tensors; until then the ticket stays valid, so a
receiver without room makes the transfer wait rather than lose it. ``abort`` (either side)
drops a transfer and everything it holds.
"""

from __future__ import annotations

import abc
import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from servelab.core.request import Request, RequestStatus
from servelab.core.request_metadata import NO_METADATA, RequestMetadata
from servelab.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from servelab.core.component import ComponentBuilder


class KVTransferError(RuntimeError):
    """A transfer that cannot complete: its peer is gone, it was aborted, or the receiving
    cache does not match the blocks sent. The message names the transfer and the reason."""

    def __init__(self, transfer_id: str, reason: str):
        super().__init__(f"KV transfer {transfer_id!r}: {reason}")
        self.transfer_id = transfer_id
        self.reason = reason


@dataclass(frozen=True, slots=True)
class HandOff:
    """What the decode instance needs of a request besides its KV: ``token_ids`` (prompt
    then the tokens generated so far, the first one(s) included) of which
    ``num_prompt_tokens`` are the prompt and ``num_computed_tokens`` have KV in the blocks
    sent; its ``sampling_params`` and ``generator_state`` (the seeded random stream, None
    without a seed).

    The rest is what the decode instance answers the client with: which sequence it is
    (``index`` of ``num_sequences`` of the API request ``group_id``; None: the request
    itself), the ``prompt`` text, its logprobs so far, its timestamps on the (host-wide
    monotonic) clock, how it ended when it already did (``finish_reason``: a sibling that
    stopped at its first token travels with the others, with no blocks), and what a delta
    stream has sent of it already (``sent_tokens`` output tokens, ``sent_chars`` characters,
    ``sent_prompt_logprobs``), so that the decode instance's deltas continue after it;
    what its scheduling policy knows of it (``metadata``, ``deadline_time``); and the name
    of the LoRA adapter it runs with (``lora``; None: the base model), which the decode
    instance must serve too; its ``cache_salt`` (the blocks it registers there stay apart
    from other salts' as they did here)."""

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator_state: torch.Tensor | None = None
    group_id: str | None = None
    index: int = 0
    num_sequences: int = 1
    prompt: str | None = None
    logprobs: tuple | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: tuple | None = None
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    token_times: tuple[float, ...] = ()
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_text_len: int | None = None
    finished_time: float | None = None
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_prompt_logprobs: bool = False
    metadata: RequestMetadata = NO_METADATA
    deadline_time: float | None = None
    lora: str | None = None
    cache_salt: str | None = None

    @classmethod
    def of(cls, request: Request, num_sequences: int = 1, sent_tokens: int = 0, sent_chars: int = 0,
           sent_prompt_logprobs: bool = False) -> "HandOff":
        """The hand-off of ``request`` as it stands (one of ``num_sequences`` siblings, of
        which a delta stream sent ``sent_tokens`` tokens, ``sent_chars`` characters and, if
        ``sent_prompt_logprobs``, the prompt's logprobs)."""
        generator, logprobs, prompt_logprobs = request.generator, request.logprobs, request.prompt_logprobs
        return cls(
            request_id=request.request_id, token_ids=tuple(request.token_ids),
            num_prompt_tokens=request.num_prompt_tokens, num_computed_tokens=request.num_computed_tokens,
            sampling_params=request.sampling_params,
            generator_state=None if generator is None else generator.get_state(),
            group_id=request.group_id, index=request.index, num_sequences=num_sequences, prompt=request.prompt,
            logprobs=None if logprobs is None else tuple(logprobs), cumulative_logprob=request.cumulative_logprob,
            prompt_logprobs=None if prompt_logprobs is None else tuple(prompt_logprobs),
            arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
            token_times=tuple(request.token_times), num_cached_prompt_tokens=request.num_cached_prompt_tokens,
            num_preemptions=request.num_preemptions, finish_reason=request.finish_reason,
            stop_reason=request.stop_reason, stop_text_len=request.stop_text_len,
            finished_time=request.finished_time, sent_tokens=sent_tokens, sent_chars=sent_chars,
            sent_prompt_logprobs=sent_prompt_logprobs, metadata=request.metadata,
            deadline_time=request.deadline_time, lora=None if request.lora is None else request.lora.name,
            cache_salt=request.cache_salt)

    @property
    def group(self) -> str:
        """The API request this sequence belongs to (``group_id``, else its own id)."""
        return self.group_id or self.request_id

    @property
    def finished(self) -> bool:
        """True for a sequence that already stopped (it carries no blocks)."""
        return self.finish_reason is not None

    def restore(self, eos_token_id: int | None, now: float, device: str | torch.device = "cpu") -> Request:
        """The request again, as the sending engine held it (``now`` stands in for an
        unknown arrival time); its blocks are the receiver's to allocate."""
        request = Request(self.request_id, list(self.token_ids[:self.num_prompt_tokens]), self.sampling_params,
                          eos_token_id, self.prompt, now if self.arrival_time is None else self.arrival_time,
                          self.index, self.group_id, self.metadata, self.deadline_time)
        request.token_ids.extend(self.token_ids[self.num_prompt_tokens:])
        request.num_computed_tokens = self.num_computed_tokens
        request.cache_salt = self.cache_salt
        if self.logprobs is not None:
            request.logprobs = list(self.logprobs)
        if self.prompt_logprobs is not None:
            request.prompt_logprobs = list(self.prompt_logprobs)
        request.cumulative_logprob = self.cumulative_logprob
        request.first_scheduled_time = self.first_scheduled_time
        request.token_times = list(self.token_times)
        request.num_cached_prompt_tokens = self.num_cached_prompt_tokens
        request.num_preemptions = self.num_preemptions
        if self.finished:
            request.status = RequestStatus.FINISHED
            request.finish_reason, request.stop_reason = self.finish_reason, self.stop_reason
            request.stop_text_len, request.finished_time = self.stop_text_len, self.finished_time
        if self.generator_state is not None:
            request.generator = torch.Generator(device=device).set_state(self.generator_state)
        return request


@dataclass(frozen=True, slots=True)
class TransferTicket:
    """One published transfer, as the receiver needs it: ``num_blocks`` blocks of every
    one of ``num_layers`` layers, each block ``block_shape`` of ``dtype`` (one block of the
    attention backend's cache layout, keys, values and scales); ``connector`` (the registered name that sent it), ``address`` (where
    that connector finds the data: a path, a rank and tag, ...), ``sender`` (the sending
    process, to tell a dead peer from a slow one) and the request's ``handoff``."""

    transfer_id: str
    connector: str
    address: str
    sender: int
    num_layers: int
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    handoff: HandOff

    @property
    def num_bytes(self) -> int:
        """Bytes the transfer moves: keys and values of every block of every layer."""
        return self.num_layers * self.num_blocks * math.prod(self.block_shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class KVTransferContext:
    """What a connector is built with: ``instance_id`` (this instance's name, unique in
    the deployment) and the engine's ``registry``."""

    instance_id: str
    registry: ComponentBuilder | None = None


class KVTransfer(abc.ABC):
    """Moves KV blocks between the cache tensors of two instances.

    Built as ``cls(config, KVTransferContext)``. ``kv_caches`` are one instance's per-layer
    cache tensors viewed with their blocks first (``Executor.local_kv_caches``: ``[num_blocks,
    *block_shape]``, possibly not contiguous, any ``cache.kv_dtype``: the bytes move as they
    are, scales included); ``block_ids`` index that first axis. ``handles_meta_caches``:
    True for a connector that takes caches of meta tensors (shapes without storage, from
    ``executor=simulated``) and prices a transfer instead of moving bytes.
    """

    handles_meta_caches: bool = False

    @abc.abstractmethod
    def send(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], handoff: HandOff) -> TransferTicket:
        """Publish the request's blocks ``block_ids`` of every layer; returns the ticket the
        receiver needs. The sender may free or reuse its blocks as soon as this returns."""

    @abc.abstractmethod
    def receive(self, ticket: TransferTicket, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> HandOff:
        """Copy the ticket's blocks into ``block_ids`` of ``kv_caches`` (as many ids as the
        ticket has blocks) and release what the transfer held; returns its ``HandOff``.
        ``KVTransferError`` naming the transfer when it was aborted, its sender is gone or
        the caches do not match; nothing was written then, and a transfer refused for a
        mismatch stays receivable."""

    @abc.abstractmethod
    def abort(self, ticket: TransferTicket) -> None:
        """Drop the transfer and what it holds, from either side; harmless if it is done."""

    @property
    @abc.abstractmethod
    def num_in_flight(self) -> int:
        """Transfers this instance sent that were neither received nor aborted."""

    def shutdown(self) -> None:
        """Drop every transfer this instance sent and not yet handed over. Nothing by default."""

    @classmethod
    def host_deployment(cls, config: Any) -> contextlib.AbstractContextManager:
        """What the process that starts a deployment's instances holds open while they run,
        for their connectors (built with ``config``) to meet, e.g. a rendezvous store that
        must outlive every instance; entered before the first instance starts and left
        after the last one stopped. Nothing by default."""
        return contextlib.nullcontext()


def check_receivable(ticket: TransferTicket, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
    """``KVTransferError`` unless ``kv_caches`` and ``block_ids`` can take the ticket's
    blocks: one tensor per layer, the same block shape and dtype, one id per block, every
    id inside the cache."""
    problem = None
    if len(kv_caches) != ticket.num_layers:
        problem = f"the receiving cache has {len(kv_caches)} layers, the blocks sent {ticket.num_layers}"
    elif len(block_ids) != ticket.num_blocks:
        problem = f"{len(block_ids)} receiving blocks for {ticket.num_blocks} blocks sent"
    elif any(tuple(c.shape[1:]) != ticket.block_shape or c.dtype != ticket.dtype for c in kv_caches):
        cache = kv_caches[0]
        problem = (f"the receiving blocks are {tuple(cache.shape[1:])} of {cache.dtype}, the blocks sent "
                   f"{ticket.block_shape} of {ticket.dtype}")
    elif block_ids and (min(block_ids) < 0 or max(block_ids) >= kv_caches[0].shape[0]):
        problem = f"block ids must be in [0, {kv_caches[0].shape[0]}), got {min(block_ids)}..{max(block_ids)}"
    if problem is not None:
        raise KVTransferError(ticket.transfer_id, problem)


def gather_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """The bytes of blocks ``block_ids`` of a blocks-first cache view, one flat uint8 tensor
    (moved as bytes, so every element type works, float8 included)."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    return kv_cache.view(torch.uint8).index_select(0, index).reshape(-1)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write ``data`` (flat uint8, as ``gather_blocks`` returns) into blocks ``block_ids``
    of a blocks-first cache view, in place (through a view too)."""
    target = kv_cache.view(torch.uint8)
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
    target.index_copy_(0, index, data.to(kv_cache.device).reshape(len(index), *target.shape[1:]))
