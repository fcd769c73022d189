"""The scheduler contract and what it hands to the model runner each step."""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from servelab.core.request import Request

if TYPE_CHECKING:
    from servelab.core.lora_admission import AdapterAdmission
    from servelab.core.policy import SchedulingPolicy
    from servelab.core.clock import Clock
    from servelab.core.decode_result import DecodeResult
    from servelab.core.kv_cache import KVCacheManager
    from servelab.core.kv_tier import TierEntry
    from servelab.core.stop_checker import StopChecker


class PreemptionMode(enum.Enum):
    """How a scheduler frees memory: ``recompute`` drops the request's blocks and computes
    its tokens again later; ``swap`` copies them to the host pool and back."""

    recompute = "recompute"
    swap = "swap"


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens after the
    ``num_computed_tokens`` already cached, stored in the blocks ``block_ids`` (a snapshot
    of the request's block table when the step was scheduled; of the cache's first KV
    cache group, ``group_block_ids`` holding the further groups' tables). ``samples`` is
    True when the grant reaches the request's last token, so the step yields a token for
    it (False for a partial prefill chunk)."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: tuple[int, ...]
    samples: bool
    group_block_ids: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, request: Request, num_new_tokens: int, cache: "KVCacheManager", samples: bool) -> "ScheduledRequest":
        """A grant of ``num_new_tokens`` after the request's computed tokens, with a
        snapshot of its block tables in ``cache``."""
        first, *rest = cache.block_tables(request)
        return cls(request, request.num_computed_tokens, num_new_tokens, tuple(first), samples,
                   tuple(map(tuple, rest)))

    @property
    def block_tables(self) -> tuple[tuple[int, ...], ...]:
        """The block table of every KV cache group."""
        return (self.block_ids, *self.group_block_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the runner needs for one step.

    ``scheduled``: requests with their token grants. ``num_prefill_tokens`` /
    ``num_decode_tokens``: the step's tokens split by kind (a decode grant is one token of
    a request with nothing else left to compute). ``blocks_to_swap_out`` /
    ``blocks_to_swap_in``: (device, host) / (host, device) block pairs to move before the
    step; ``blocks_to_copy``: (source, destination) device blocks (copy-on-write);
    ``blocks_to_offload``: (device, host) blocks whose cached content moves down to the
    cache's host tier as the device block is reused (``blocks_to_swap_in`` also carries the
    host tier's blocks loaded back on a prefix hit). An executor applies them offloads
    first (they read device blocks this step may overwrite), then swap-ins, then
    swap-outs, then copies: a host block a swap-in frees may be taken by a swap-out of the
    same step. ``blocks_to_spill``: (host block, ``TierEntry``) pairs the cache's lower
    tier saves (host-tier blocks evicted), ``blocks_to_fill``: (``TierEntry``, host block)
    pairs it loads into staging host blocks (prefix hits there, used from the next step);
    an executor hands both to ``KVCacheManager.transfer_tier_blocks`` before the moves
    above (a spilled host block may be reused by an offload or swap-out of the step).
    ``preempted``: ids preempted while building this step. ``num_lookahead_tokens``:
    speculative slots reserved after each decode grant. ``num_prefix_hit_tokens``: prompt
    tokens of the requests admitted this step that the prefix cache already held.
    ``step_index``: the scheduler's step counter.
    """

    scheduled: tuple[ScheduledRequest, ...]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    preempted: tuple[str, ...] = ()
    num_lookahead_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    step_index: int = 0
    blocks_to_offload: tuple[tuple[int, int], ...] = ()
    blocks_to_spill: tuple[tuple[int, TierEntry], ...] = ()
    blocks_to_fill: tuple[tuple[TierEntry, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens in the step's forward pass."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step and no block moves."""
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.blocks_to_offload
                    or self.blocks_to_fill or self.blocks_to_spill)

    @property
    def sampling_requests(self) -> tuple[Request, ...]:
        """The requests that yield tokens this step, in the order of a ``DecodeResult``."""
        return tuple(g.request for g in self.scheduled if g.samples)


@dataclass(frozen=True, slots=True)
class SchedulerUpdate:
    """What applying one step's result changed: ``changed`` lists every request whose
    state moved (tokens appended or finished), ``num_generated_tokens`` counts the tokens
    the requests kept (after stop conditions cut a speculative run short)."""

    changed: tuple[Request, ...] = ()
    num_generated_tokens: int = 0

    @property
    def num_finished(self) -> int:
        """Requests of ``changed`` that stopped in this step."""
        return sum(r.is_finished for r in self.changed)


@dataclass(frozen=True, slots=True)
class SchedulerContext:
    """What the engine hands a scheduler.

    ``cache``: the KV cache manager it allocates from. ``max_model_len``: prompt + output
    limit per sequence. ``num_lookahead_tokens``: speculative slots to reserve after each
    decode grant (0 without speculation). ``stop_checker``: appends sampled tokens and
    their logprobs and decides when a request stops. ``on_request_finished``: called once
    per finished or aborted request, after its cache is freed (the decoding strategy drops
    its per-request state). ``clock``: the engine's time, for timestamps and timers.
    ``policy``: the engine's scheduling policy (``policy=...``), which orders the requests
    (None: first come, first served; ``QueueScheduler`` builds that one). ``adapters``:
    with LoRA, the adapter-aware admission that keeps a step's adapters within the slots
    (``AdapterAdmission``; None: admission ignores adapters).
    """

    cache: KVCacheManager
    max_model_len: int
    num_lookahead_tokens: int
    stop_checker: StopChecker
    on_request_finished: Callable[[Request], None]
    clock: Clock
    policy: SchedulingPolicy | None = None
    adapters: AdapterAdmission | None = None


class Scheduler(abc.ABC):
    """Decides which requests run each step and how many tokens each gets.

    Built as ``cls(config, SchedulerContext)``; a constructor raises ``ConfigError``
    listing every problem of its config. Policies (static, dynamic, continuous, chunked,
    ...) differ only in ``schedule``; all emit the same ``SchedulerOutput``. Steps may be
    in flight several at a time (a pipeline): ``schedule`` never grants a request whose
    previous grant has not come back through ``update_from_output``.
    """

    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a validated request."""

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their cache slots."""

    @abc.abstractmethod
    def update_from_output(self, output: SchedulerOutput, result: DecodeResult | None) -> SchedulerUpdate:
        """Apply the step's result, the one channel through which sampled tokens reach
        requests: ``result.token_ids[i]`` (with their logprobs and speculative counts)
        belong to ``output.sampling_requests[i]``; ``result`` is None when no request
        sampled. Advance token accounting, stop finished requests and free their cache."""

    @abc.abstractmethod
    def abort(self, request_ids: list[str]) -> list[Request]:
        """Stop these requests now and free their cache; returns those found."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""

    @property
    @abc.abstractmethod
    def num_running(self) -> int:
        """Requests holding cache now."""

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Requests queued (new, preempted or swapped)."""

    def max_step_tokens(self) -> int | None:
        """The most tokens (lookahead slots included) one step of this policy holds, which
        is what ``LLMEngine.warm_up`` prepares kernels for; None when the policy sets no
        bound (the engine then uses ``max_model_len``)."""
        return None

    def max_num_seqs(self) -> int | None:
        """The most requests one step schedules; None when the policy sets no bound."""
        return None

    def take_refused(self) -> list[Request]:
        """The requests this scheduler finished on its own since the last call (its policy
        refused them: finish reason ``deadline``), for the engine to report; none by default."""
        return []

    def next_wakeup(self) -> float | None:
        """For policies that wait on a timer with nothing to run: when to step again (on
        the context's clock); None otherwise."""
        return None
