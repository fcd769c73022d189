"""Capacity search over a fake system whose P99 TBT grows with the rate."""

from __future__ import annotations

import math

import pytest

from servelab.bench.capacity import search_capacity
from servelab.core.errors import ConfigError


def fake_tbt(rate: float) -> dict[str, float]:
    """P99 TBT of a system whose latency explodes near 10 requests/s."""
    return {"tbt_p99_ms": 20.0 / max(1e-9, 1 - rate / 10) if rate < 10 else math.nan}


def tbt(limit: float) -> dict[str, float]:
    """The TBT objective alone."""
    return {"tbt_p99_ms": limit}


def test_finds_the_highest_rate_meeting_the_slo():
    # 20 / (1 - r/10) <= 50  <=>  r <= 6
    found = search_capacity(fake_tbt, tbt(50.0), 1.0, 64.0, max_iterations=20, tolerance=0.01)
    assert found["limited_by"] is None
    low, high = found["bracket"]
    assert low <= 6.0 <= high and high / low - 1 < 0.01
    assert found["capacity_rps"] == low and fake_tbt(low)["tbt_p99_ms"] <= 50
    assert [t["rate"] for t in found["trials"][:2]] == [1.0, 64.0]


def test_iterations_are_bounded():
    found = search_capacity(fake_tbt, tbt(50.0), 1.0, 64.0, max_iterations=4, tolerance=0.0)
    assert len(found["trials"]) == 4 and found["capacity_rps"] <= 6.0


def test_range_ends():
    assert search_capacity(fake_tbt, tbt(10.0), 1.0, 8.0, 8, 0.1)["capacity_rps"] == 0.0
    found = search_capacity(lambda rate: {"tbt_p99_ms": 1.0}, tbt(10.0), 1.0, 8.0, 8, 0.1)
    assert found["capacity_rps"] == 8.0 and found["limited_by"] == "rate_high"
    with pytest.raises(ConfigError, match="rate_low"):
        search_capacity(fake_tbt, tbt(10.0), 8.0, 1.0, 8, 0.1)


def test_the_scheduling_delay_objective_lowers_capacity():
    """A queue that builds from 4 requests/s: median delay 500 ms per request/s above it."""
    def measured(rate: float) -> dict[str, float]:
        return {**fake_tbt(rate), "scheduling_delay_p50_ms": max(0.0, rate - 4) * 500}
    both = {"tbt_p99_ms": 50.0, "scheduling_delay_p50_ms": 1000.0}
    found = search_capacity(measured, both, 1.0, 64.0, max_iterations=30, tolerance=0.001)
    assert found["capacity_rps"] == pytest.approx(6.0, rel=0.01)   # TBT alone allows 6
    found = search_capacity(measured, {**both, "scheduling_delay_p50_ms": 500.0}, 1.0, 64.0, 30, 0.001)
    assert found["capacity_rps"] == pytest.approx(5.0, rel=0.01)
    assert all(set(t) == {"rate", "tbt_p99_ms", "scheduling_delay_p50_ms", "meets_slo"} for t in found["trials"])
