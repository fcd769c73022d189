"""The scheduler contract and what it hands to the model runner each step."""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any

from servelab.core.request import Request


class PreemptionMode(enum.Enum):
    """How a scheduler frees memory: ``recompute`` drops the request's blocks and computes
    its tokens again later; ``swap`` copies them to the host pool and back."""

    recompute = "recompute"
    swap = "swap"


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens after the
    ``num_computed_tokens`` already cached, stored in the blocks ``block_ids``.
    ``samples`` is True when the grant reaches the request's last token, so the step
    yields a token for it (False for a partial prefill chunk)."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    samples: bool


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the runner needs for one step.

    ``scheduled``: requests with their token grants. ``blocks_to_swap_out`` /
    ``blocks_to_swap_in``: (device, host) / (host, device) block pairs to move before the
    step; ``blocks_to_copy``: (source, destination) device blocks (copy-on-write).
    ``preempted``: ids preempted while building this step. ``finished_ids``: requests
    finished or aborted since the previous step (strategies drop their state).
    """

    scheduled: tuple[ScheduledRequest, ...]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    preempted: tuple[str, ...] = ()
    num_lookahead_tokens: int = 0
    step_index: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Tokens in the step's forward pass."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.scheduled and not self.blocks_to_swap_out


class Scheduler(abc.ABC):
    """Decides which requests run each step and how many tokens each gets.

    Policies (static, dynamic, continuous, chunked, ...) differ only in ``schedule``; all
    emit the same ``SchedulerOutput``.
    """

    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a validated request."""

    @abc.abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their cache slots."""

    @abc.abstractmethod
    def update_from_output(self, output: SchedulerOutput, token_ids: list[list[int]] | None) -> list[Request]:
        """Apply sampled tokens (``token_ids[i]`` for the i-th sampling request of
        ``output``), check stop conditions, free finished requests; return every request
        whose state changed."""

    @abc.abstractmethod
    def adopt(self, request: Request) -> None:
        """Run a request that already holds cache blocks (a forked beam) from now on."""

    @abc.abstractmethod
    def abort(self, request_ids: list[str]) -> list[Request]:
        """Stop these requests now and free their cache; returns those found."""

    @abc.abstractmethod
    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""

    def max_step_tokens(self) -> int | None:
        """The most tokens one step of this policy holds (what ``LLMEngine.warm_up``
        prepares kernels for); None when the policy sets no such bound."""
        return None

    def next_wakeup(self) -> float | None:
        """For policies that wait on a timer with nothing to run: when to step again
        (``time.perf_counter`` seconds); None otherwise."""
        return None

    @property
    @abc.abstractmethod
    def num_running(self) -> int:
        """Requests holding cache now."""

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Requests queued (new, preempted or swapped)."""


@dataclass(frozen=True, slots=True)
class SchedulerContext:
    """What the engine hands a scheduler: the ``cache`` manager, the ``max_model_len``
    limit, ``num_lookahead_tokens`` to reserve for speculative decoding, the
    ``stop_checker`` that appends tokens, and ``on_request_finished`` (called once per
    finished or aborted request, after its cache is freed)."""

    cache: Any
    max_model_len: int
    num_lookahead_tokens: int
    stop_checker: Any
    on_request_finished: Any
