"""Metric computations on hand-made timelines: latencies, percentiles, goodput, KV waste."""

from __future__ import annotations

import math

import pytest

from servelab.bench.config import SloConfig
from servelab.bench.metrics import RequestRecord, distribution_ms, percentile, summarize
from servelab.bench.report import markdown_table, summary_table
from servelab.bench.step_observer import StepObserver
from servelab.core.kv_cache import KVCacheUsage
from servelab.core.step_stats import StepStats


def record(rid: str, arrival: float, times: list[float], prompt: int = 10, outputs: int | None = None, **kw) -> RequestRecord:
    return RequestRecord(rid, arrival, tuple(times), prompt, len(times) if outputs is None else outputs, **kw)


# Request a: arrives at 0, tokens at 0.1, 0.2, 0.4 -> TTFT 100 ms, gaps 100, 200, TPOT 150, E2E 400.
# Request b: arrives at 1.0, tokens at 1.3, 1.35 -> TTFT 300 ms, gap 50, TPOT 50, E2E 350.
# Request c: arrives at 1.0, one token at 1.5 -> TTFT 500 ms, no gap, no TPOT, E2E 500.
A = record("a", 0.0, [0.1, 0.2, 0.4])
B = record("b", 1.0, [1.3, 1.35])
C = record("c", 1.0, [1.5])


def test_request_latencies():
    assert A.ttft == pytest.approx(0.1) and A.e2e == pytest.approx(0.4) and A.tpot == pytest.approx(0.15)
    assert A.itls == pytest.approx([0.1, 0.2])
    assert C.tpot is None and C.itls == []
    chunked = record("d", 0.0, [0.1, 0.4], outputs=4)  # 2 streamed chunks carrying 4 tokens
    assert chunked.tpot == pytest.approx(0.1) and chunked.itls == pytest.approx([0.3])


def test_percentile_interpolates_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0 and math.isnan(percentile([], 50))
    assert distribution_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_summary_of_a_timeline():
    m = summarize([A, B, C], SloConfig())
    assert m["num_completed"] == 3 and m["num_failed"] == 0
    assert m["duration_s"] == pytest.approx(1.5)
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(6 / 1.5)
    assert m["total_token_throughput"] == pytest.approx(36 / 1.5)
    assert m["ttft_ms"]["mean"] == pytest.approx(300) and m["ttft_ms"]["p50"] == pytest.approx(300)
    assert m["ttft_ms"]["p90"] == pytest.approx(460) and m["ttft_ms"]["p99"] == pytest.approx(496)
    assert m["tpot_ms"]["mean"] == pytest.approx(100) and m["tpot_ms"]["p50"] == pytest.approx(100)
    gaps = sorted([100, 200, 50])
    assert m["itl_ms"]["p50"] == pytest.approx(gaps[1]) and m["itl_ms"]["p99"] == pytest.approx(198)
    assert m["e2e_ms"]["p50"] == pytest.approx(400)
    assert m["goodput"] == pytest.approx(m["request_throughput"]) and m["slo_attainment"] == 1.0


def test_scheduling_delay_when_reported():
    delayed = [record("a", 0.0, [0.5], scheduled_time=0.25), record("b", 1.0, [2.0], scheduled_time=1.75), C]
    assert delayed[0].scheduling_delay == pytest.approx(0.25) and C.scheduling_delay is None
    m = summarize(delayed, SloConfig())
    assert m["scheduling_delay_ms"]["p50"] == pytest.approx(500) and m["scheduling_delay_ms"]["mean"] == pytest.approx(500)
    assert summarize([A, B], SloConfig())["scheduling_delay_ms"]["p50"] is None


def test_normalized_latency_is_the_mean_latency_per_output_token():
    # a: 400 ms / 3 tokens, b: 350 ms / 2, c: 500 ms / 1
    assert summarize([A, B, C], SloConfig())["normalized_latency_ms"] == pytest.approx((400 / 3 + 175 + 500) / 3)
    assert summarize([], SloConfig())["normalized_latency_ms"] is None


def test_goodput_counts_requests_meeting_every_slo():
    # TTFT <= 350 ms drops c; TPOT <= 120 ms drops a (150 ms); b meets both.
    m = summarize([A, B, C], SloConfig(ttft_ms=350, tpot_ms=120))
    assert m["goodput"] == pytest.approx(1 / 1.5) and m["slo_attainment"] == pytest.approx(1 / 3)
    # A single-token request has no TPOT and meets any TPOT objective.
    assert summarize([C], SloConfig(tpot_ms=1))["slo_attainment"] == 1.0


def test_failures_cache_hits_and_speculation():
    failed = RequestRecord("x", 0.5, (), 10, 0, error="HTTP 500: boom")
    hit = record("h", 0.0, [0.1, 0.2], prompt=32, num_cached_prompt_tokens=16, num_preemptions=2,
                 spec_proposed=8, spec_accepted=6)
    m = summarize([hit, failed], SloConfig())
    assert m["num_failed"] == 1 and m["errors"] == ["HTTP 500: boom"]
    assert m["prefix_cache_hit_rate"] == 0.5 and m["preemptions"] == 2 and m["spec_acceptance_rate"] == 0.75


def stats(reserved: int, used: int, dt: float, running: int = 1, preempted: int = 0) -> StepStats:
    kv = KVCacheUsage(total_slots=1000, reserved_slots=reserved, used_slots=used, total_blocks=10, used_blocks=1)
    return StepStats(step_index=0, num_prefill_tokens=4, num_decode_tokens=1, num_scheduled=running,
                     num_running=running, num_waiting=0, num_preempted=preempted, num_finished=0,
                     num_generated_tokens=1, kv=kv, step_time_s=dt)


def test_step_observer_time_weights_kv_waste():
    observer = StepObserver()
    observer.servelab_step_end(None, stats(100, 50, 1.0, running=3))   # 50% waste for 1 s
    observer.servelab_step_end(None, stats(400, 400, 3.0, preempted=1))  # no waste for 3 s
    s = observer.summary()
    assert s["kv_waste"] == pytest.approx(1 - (50 + 1200) / (100 + 1200))
    assert s["kv_peak_reserved_slots"] == 400 and s["kv_peak_usage"] == 0.4
    assert s["peak_running"] == 3 and s["step_preemptions"] == 1 and s["num_steps"] == 2
    assert s["mean_batched_tokens"] == 5 and s["prefill_token_share"] == 0.8


def test_step_observer_reports_the_accepted_length():
    observer = StepObserver()
    observer.servelab_step_end(None, stats(10, 10, 1.0))  # a prefill: nothing verified
    for accepted in (3, 0, 1):  # three verifications of one request: 4, 1 and 2 tokens
        observer.servelab_step_end(None, StepStats(**{**{f: getattr(stats(10, 10, 1.0), f) for f in StepStats.__slots__},
                                                      "spec_proposed": 4, "spec_accepted": accepted,
                                                      "spec_verified": 1}))
    assert observer.summary()["spec_accepted_length"] == pytest.approx(7 / 3)
    m = {**summarize([A], SloConfig()), "system": {"name": "servelab", "spec_accepted_length": 7 / 3}}
    assert "accepted length" in summary_table(m) and "2.33" in summary_table(m)


def test_step_observer_tables_the_rank_of_each_kept_draft():
    """Per depth reached with drafts to try, the share that kept each sibling rank (the
    table executor.tree_acceptance reads)."""
    observer = StepObserver()
    ranks = ([0, 1, -1], [1, -1], [0, 0], [])  # ranks kept per depth (-1: none); the last verified nothing
    observer.servelab_step_end(None, StepStats(**{**{f: getattr(stats(10, 10, 1.0), f) for f in StepStats.__slots__},
                                                  "spec_ranks": ranks}))
    summary = observer.summary()
    assert summary["spec_depth_reached"] == [3, 3, 1]
    assert summary["spec_rank_acceptance"] == [[2 / 3, 1 / 3], [1 / 3, 1 / 3], []]


def test_tables_render_every_present_metric():
    m = {**summarize([A, B, C], SloConfig()), "system": {"name": "servelab", "kv_waste": 0.25},
         "workload": {"rate": 4.0}, "job": {"label": "cache=paged"}}
    text = summary_table(m)
    assert "KV waste %" in text and "25" in text and "spec accept %" not in text
    table = markdown_table([m, {**m, "job": {"label": "cache=contiguous"}}])
    lines = table.splitlines()
    assert lines[0].startswith("| job | system | rate req/s | req/s |") and len(lines) == 4
    assert lines[2].startswith("| cache=paged | servelab | 4 | 2 |")
