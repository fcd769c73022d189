"""A ``servelab_step_end`` observer that aggregates KV memory and batch statistics."""

from __future__ import annotations

from typing import Any

from servelab.core.hookspecs import hookimpl


class StepObserver:
    """Accumulates per-step ``StepStats`` while registered: of ``engine`` alone when given,
    else of every engine of the registry (the replicas of a cluster together).

    KV waste is time-weighted: each step's snapshot (taken after the step) counts for the
    step's time, so waste = 1 - sum(read_slots * dt) / sum(reserved_slots * dt), the share
    of the memory held over the run that holds nothing attention reads (empty slots, and
    windowed layers' tokens before the window: ``KVCacheUsage.unread_slots``). With pipeline stages,
    each stage's busy seconds add up and its bubble fraction is the share of the engine's
    busy time the stage sat idle. Speculative steps' kept ranks give the acceptance table
    ``executor.tree_acceptance`` reads: ``spec_rank_acceptance[d][r]``, the share of the
    verifications that reached depth d (``spec_depth_reached[d]``, drafts to try there)
    which kept the rank-r draft.
    """

    def __init__(self, engine: Any = None) -> None:
        self.engine = engine
        self.num_steps = 0
        self.busy_s = 0.0
        self.reserved_slot_s = 0.0
        self.read_slot_s = 0.0
        self.total_slots = 0
        self.peak_reserved_slots = 0
        self.peak_used_slots = 0
        self.peak_running = 0
        self.batched_tokens = 0
        self.prefill_tokens = 0
        self.preempted = 0
        self.prefix_hit_tokens = 0
        self.spec_proposed = 0
        self.spec_accepted = 0
        self.spec_verified = 0
        self.rank_hits: list[list[int]] = []
        self.depth_reached: list[int] = []
        self.stage_busy_s: list[float] = []
        self._evicted_blocks: dict[int, int] = {}
        self._tier_hits: dict[int, dict[str, int]] = {}

    @hookimpl
    def servelab_step_end(self, engine: Any, stats: Any) -> None:
        """Fold one step's statistics in (only ``engine``'s steps, when one was given)."""
        if self.engine is not None and engine is not self.engine:
            return
        kv, dt = stats.kv, stats.step_time_s
        self.num_steps += 1
        self.busy_s += dt
        self.reserved_slot_s += kv.reserved_slots * dt
        self.read_slot_s += kv.read_slots * dt
        self.total_slots = kv.total_slots
        self.peak_reserved_slots = max(self.peak_reserved_slots, kv.reserved_slots)
        self.peak_used_slots = max(self.peak_used_slots, kv.used_slots)
        self.peak_running = max(self.peak_running, stats.num_running + stats.num_finished)
        self.batched_tokens += stats.num_prefill_tokens + stats.num_decode_tokens
        self.prefill_tokens += stats.num_prefill_tokens
        self.preempted += stats.num_preempted
        self.prefix_hit_tokens += stats.prefix_hit_tokens
        if engine is not None:
            self._evicted_blocks[id(engine)] = engine.cache.prefix_evicted_blocks
            self._tier_hits[id(engine)] = engine.cache.tier_hit_tokens
        self.spec_proposed += stats.spec_proposed
        self.spec_accepted += stats.spec_accepted
        self.spec_verified += stats.spec_verified
        for ranks in stats.spec_ranks:
            self._count_ranks(ranks)
        if len(self.stage_busy_s) < len(stats.stage_busy_s):
            self.stage_busy_s += [0.0] * (len(stats.stage_busy_s) - len(self.stage_busy_s))
        for stage, busy in enumerate(stats.stage_busy_s):
            self.stage_busy_s[stage] += busy

    def _count_ranks(self, ranks: list[int]) -> None:
        """One verified request's kept ranks (``StepStats.spec_ranks``): each depth it
        reached, and the rank kept there (-1: none)."""
        for depth, rank in enumerate(ranks):
            if depth == len(self.depth_reached):
                self.depth_reached.append(0)
                self.rank_hits.append([])
            self.depth_reached[depth] += 1
            if rank >= 0:
                hits = self.rank_hits[depth]
                hits += [0] * (rank + 1 - len(hits))
                hits[rank] += 1

    def summary(self) -> dict[str, Any]:
        """The aggregated statistics as plain values for ``metrics.json``."""
        steps = self.num_steps or 1
        return {
            "num_steps": self.num_steps,
            "busy_s": self.busy_s,
            "kv_total_slots": self.total_slots,
            "kv_peak_reserved_slots": self.peak_reserved_slots,
            "kv_peak_used_slots": self.peak_used_slots,
            "kv_peak_usage": self.peak_reserved_slots / self.total_slots if self.total_slots else None,
            "kv_waste": 1 - self.read_slot_s / self.reserved_slot_s if self.reserved_slot_s else None,
            "peak_running": self.peak_running,
            "mean_batched_tokens": self.batched_tokens / steps,
            "prefill_token_share": self.prefill_tokens / self.batched_tokens if self.batched_tokens else None,
            "step_preemptions": self.preempted,
            "step_prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_evicted_blocks": sum(self._evicted_blocks.values()),
            "tier_hit_tokens": {tier: sum(hits.get(tier, 0) for hits in self._tier_hits.values())
                                for tier in sorted({t for hits in self._tier_hits.values() for t in hits})},
            "step_spec_acceptance_rate": self.spec_accepted / self.spec_proposed if self.spec_proposed else None,
            "spec_accepted_length": 1 + self.spec_accepted / self.spec_verified if self.spec_verified else None,
            "spec_rank_acceptance": [[hit / reached for hit in hits] for hits, reached in
                                     zip(self.rank_hits, self.depth_reached)] or None,
            "spec_depth_reached": list(self.depth_reached) or None,
            "stage_busy_s": list(self.stage_busy_s),
            "stage_bubble_fraction": [1 - busy / self.busy_s if self.busy_s else None for busy in self.stage_busy_s],
        }
