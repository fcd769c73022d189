"""Latency and throughput metrics of one run, computed from per-request timelines.

Definitions (docs/bench.md): TTFT = first token - arrival; TPOT = (E2E - TTFT) /
(output tokens - 1); ITL/TBT = every gap between consecutive token arrivals; E2E = last
token - arrival; normalized latency = the mean of E2E / output tokens (PagedAttention); goodput = completed requests per second meeting every SLO set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request did, as the client saw it.

    ``arrival_time``: when it was sent (``time.perf_counter`` seconds). ``token_times``:
    when output arrived, one entry per token in process or per streamed chunk over HTTP
    (a chunk may carry several tokens), so ``num_output_tokens`` is counted separately.
    ``error`` is set, and the timings empty, when the request failed. The counters
    after ``num_output_tokens`` are None when the system does not report them;
    ``scheduled_time`` is when the system first scheduled the request (same clock).
    ``tenant``, ``priority`` and ``slo_class`` are the request's metadata (None without
    tenants); ``finish_reason`` is the system's (``length``, ``stop``, ``deadline``: refused
    by ``policy=deadline``; None when not reported). ``output_token_ids``: the generated
    tokens, which closed-loop workloads feed back (None when not reported).
    """

    request_id: str
    arrival_time: float
    token_times: tuple[float, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int | None = None
    num_preemptions: int | None = None
    spec_proposed: int | None = None
    spec_accepted: int | None = None
    error: str | None = None
    scheduled_time: float | None = None
    tenant: str | None = None
    priority: int | None = None
    slo_class: str | None = None
    finish_reason: str | None = None
    output_token_ids: tuple[int, ...] | None = None

    @property
    def ok(self) -> bool:
        """True when the request produced output without an error."""
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        """Time to first token, seconds."""
        return self.token_times[0] - self.arrival_time

    @property
    def scheduling_delay(self) -> float | None:
        """Arrival to first scheduled (Sarathi-Serve's scheduling delay), seconds; None when
        the system does not report it."""
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float:
        """Arrival to last token, seconds."""
        return self.token_times[-1] - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for a single output token."""
        if self.num_output_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Every gap between consecutive token (or chunk) arrivals, seconds."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between order statistics
    (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and P50/P90/P99 of seconds, in milliseconds (None when there are no values)."""
    if not values_s:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = [1000 * v for v in values_s]
    return {"mean": sum(ms) / len(ms), **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


def _total(values: Sequence[int | None]) -> int | None:
    """Sum of the reported values; None when no record reports any."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _ratio(numerator: int | None, denominator: int | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def prefix_cache_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    """Prompt tokens found in the prefix cache over all prompt tokens of the completed
    ``records``; None when no record reports cached tokens."""
    done = [r for r in records if r.ok]
    return _ratio(_total([r.num_cached_prompt_tokens for r in done]), sum(r.num_prompt_tokens for r in done))


def meets_slo(record: RequestRecord, ttft_ms: float | None, tpot_ms: float | None) -> bool:
    """True when the request met the TTFT and TPOT objectives that are set."""
    if ttft_ms is not None and 1000 * record.ttft > ttft_ms:
        return False
    tpot = record.tpot
    return tpot_ms is None or tpot is None or 1000 * tpot <= tpot_ms


def summarize(records: Sequence[RequestRecord], slo: Any) -> dict[str, Any]:
    """Throughput, latency distributions, goodput and cache/speculation ratios of a run.

    The run lasts from the first arrival to the last token received. ``slo`` has
    ``ttft_ms`` and ``tpot_ms`` (None = no objective; with none set, goodput equals the
    request throughput).
    """
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    start = min((r.arrival_time for r in records), default=0.0)
    end = max((r.token_times[-1] for r in done), default=start)
    duration = end - start
    rate = (lambda count: count / duration) if duration > 0 else (lambda count: math.nan)
    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    good = sum(meets_slo(r, slo.ttft_ms, slo.tpot_ms) for r in done)
    itls = [gap for r in done for gap in r.itls]
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:5],
        "duration_s": duration,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(prompt_tokens + output_tokens),
        "mean_prompt_tokens": prompt_tokens / len(done) if done else None,
        "mean_output_tokens": output_tokens / len(done) if done else None,
        "ttft_ms": distribution_ms([r.ttft for r in done]),
        "tpot_ms": distribution_ms([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms(itls),
        "e2e_ms": distribution_ms([r.e2e for r in done]),
        "scheduling_delay_ms": distribution_ms([d for r in done if (d := r.scheduling_delay) is not None]),
        "normalized_latency_ms": (1000 * sum(r.e2e / r.num_output_tokens for r in done if r.num_output_tokens)
                                  / len(done)) if done else None,
        "goodput": rate(good),
        "slo_attainment": good / len(done) if done else None,
        "preemptions": _total([r.num_preemptions for r in done]),
        "prefix_cache_hit_rate": prefix_cache_hit_rate(done),
        "spec_acceptance_rate": _ratio(_total([r.spec_accepted for r in done]), _total([r.spec_proposed for r in done])),
    }
