"""Per-step statistics for observers and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

from servelab.core.kv_cache import KVCacheUsage


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one engine step did.

    Token counts split prefill and decode work; ``kv`` is the cache after the step;
    ``num_preempted`` counts requests preempted while scheduling it; ``prefix_hit_tokens``
    counts prompt tokens found in the prefix cache at admission; ``spec_proposed`` /
    ``spec_accepted`` count draft tokens verified and kept, ``spec_verified`` the requests
    whose drafts were verified (mean accepted length = 1 + accepted / verified);
    ``step_time_s`` is the time the
    step took on the engine's clock (virtual under ``executor=simulated``);
    ``stage_busy_s``: seconds each pipeline stage computed for it (empty when the
    executor does not measure stages); ``clock_s``: the clock when the step ended;
    ``spec_ranks``: per verified request, the sibling rank of each kept draft and -1 for
    a depth where none was kept (``DecodeResult.accepted_ranks``; empty when not reported).
    """

    step_index: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_scheduled: int
    num_running: int
    num_waiting: int
    num_preempted: int
    num_finished: int
    num_generated_tokens: int
    kv: KVCacheUsage
    step_time_s: float
    prefix_hit_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    stage_busy_s: tuple[float, ...] = ()
    clock_s: float = 0.0
    spec_verified: int = 0
    spec_ranks: tuple[list[int], ...] = ()
