"""The messages between the server process and the engine process of ``servelab-serve``,
pickled through one ``multiprocessing`` pipe.

server -> engine: ``AddRequest``, ``AbortRequests``, ``UpdateLoRA``, ``StopEngine``; in a disaggregated
deployment also ``AdmitHandedOff`` (to a decode instance) and ``AbortTransfers``.
engine -> server: ``EngineReady`` or ``EngineConfigError`` once at start-up, then
``RequestAdded`` for every ``AddRequest``, ``LoRAUpdated`` for every ``UpdateLoRA``, a
``StepReport`` after every step (and after
aborts), and ``EngineFailed`` once if the loop fails; a prefill instance sends
``HandedOff`` for every request it hands off, a decode instance ``RequestFailed`` for one
it cannot admit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servelab.core.kv_cache import KVCacheEvent, KVCacheUsage
from servelab.core.kv_transfer import TransferTicket
from servelab.core.outputs import RequestOutput
from servelab.core.policy import SLOClass
from servelab.core.request_metadata import NO_METADATA, RequestMetadata
from servelab.core.sampling_params import SamplingParams
from servelab.core.step_stats import StepStats


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the server knows of its engine without asking: limits, the tokenizer (for
    /tokenize, /detokenize, echo and chat templates) and which metrics exist (the
    ``slo_classes`` get an attainment counter); the LoRA adapters it serves at start-up
    (``lora_adapters``: name to folder; ``lora_enabled``: whether it serves any)."""

    max_model_len: int
    vocab_size: int
    tokenizer: Any
    prefix_caching: bool
    speculative: bool
    block_size: int
    slo_classes: dict[str, SLOClass] = field(default_factory=dict)
    lora_enabled: bool = False
    lora_adapters: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, engine: Any) -> "EngineInfo":
        """The info of a built ``LLMEngine``."""
        return cls(engine.max_model_len, engine.vocab_size, engine.tokenizer, engine.cache.prefix_caching,
                   engine.strategy.num_lookahead_tokens > 0, engine.cache.block_size, dict(engine.slo_classes),
                   engine.lora is not None, engine.lora_adapters())


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Validate and queue ``prompt`` (text or token ids) under ``request_id`` with its
    scheduling ``metadata``, LoRA adapter (``lora``, None: the base model) and
    ``cache_salt``; its outputs stream back as deltas in ``StepReport``s."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    metadata: RequestMetadata = NO_METADATA
    lora: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class UpdateLoRA:
    """Load the engine's adapter store's adapter at ``path`` (None: the one it serves as
    ``name``) as ``name``, or unload ``name`` (``load`` False); answered by
    ``LoRAUpdated`` with the same ``command_id``."""

    command_id: int
    name: str
    path: str | None
    load: bool = True


@dataclass(frozen=True, slots=True)
class LoRAUpdated:
    """The result of ``UpdateLoRA`` ``command_id``: ``error`` (an ``InvalidRequestError``)
    or None when done; ``source``, where a loaded adapter was read."""

    command_id: int
    error: Exception | None = None
    source: str | None = None


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """Abort these requests (unknown ids are ignored)."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AdmitHandedOff:
    """Continue a request a prefill instance handed off: admit ``tickets`` (one per
    sequence) when the cache has room, in the order they came; outputs stream back as
    deltas from the first token."""

    tickets: tuple[TransferTicket, ...]

    @property
    def request_id(self) -> str:
        """The API request the tickets continue."""
        return self.tickets[0].handoff.group


@dataclass(frozen=True, slots=True)
class AbortTransfers:
    """Drop these transfers (their request ended before a decode instance took them)."""

    tickets: tuple[TransferTicket, ...]


@dataclass(frozen=True, slots=True)
class StopEngine:
    """Abort what runs and exit the engine process."""


@dataclass(frozen=True, slots=True)
class EngineReady:
    """The engine is built and warmed up."""

    info: EngineInfo


@dataclass(frozen=True, slots=True)
class EngineConfigError:
    """The configuration cannot work; ``problems`` lists every reason."""

    problems: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RequestAdded:
    """The answer to an ``AddRequest``: the prompt's length, or the ``error``
    (an ``InvalidRequestError`` naming the field) that kept it out of the engine."""

    request_id: str
    prompt_length: int
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class StepReport:
    """What changed since the last report: delta outputs, the steps' statistics, the
    scheduler's gauges, the cache's occupancy (``kv``, None before the first report),
    the sequences aborted on request (``aborted``: their request ids, one per sequence),
    for a KV-aware router, what the prefix cache stored and evicted (``cache_events``),
    and the LoRA adapter slots' counters (``lora``: a ``LoRAStats``, None without LoRA)."""

    outputs: tuple[RequestOutput, ...] = ()
    stats: tuple[StepStats, ...] = ()
    num_running: int = 0
    num_waiting: int = 0
    kv: KVCacheUsage | None = None
    aborted: tuple[str, ...] = ()
    cache_events: tuple[KVCacheEvent, ...] = ()
    lora: Any = None


@dataclass(frozen=True, slots=True)
class HandedOff:
    """A prefill instance published ``request_id``'s KV and state (``tickets``, one per
    sequence) and dropped it: a decode instance continues it."""

    request_id: str
    tickets: tuple[TransferTicket, ...]


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """A decode instance could not continue ``request_id``: ``error`` names why (a
    request whose KV can never fit its cache, a failed transfer)."""

    request_id: str
    error: Exception


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The engine loop failed; every later ``AddRequest`` is refused."""

    description: str
