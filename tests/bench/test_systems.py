"""The in-process systems on tiny workloads: servelab with arrivals, capacity search,
the transformers baseline, and the vLLM baseline's message when vLLM is missing."""

from __future__ import annotations

import importlib.util

import pytest

from servelab.bench.capacity import measure_capacity
from servelab.bench.runner import measure, open_system
from servelab.bench.workload import build_workload
from servelab.core.errors import ConfigError

SMALL = ("workload.num_requests=6", "workload.input_range=[8,24]", "workload.output_range=[3,6]", "warmup_requests=1")


def test_servelab_inproc_with_poisson_arrivals(bench_config, tmp_path):
    cfg = bench_config(*SMALL, "workload.arrival=poisson", "workload.rate=40", "cache.block_size=4")
    system = open_system(cfg, str(tmp_path))
    try:
        metrics = measure(system, cfg)
    finally:
        system.close()
    wanted = [r.max_tokens for r in build_workload(cfg.workload, system.space)]
    assert metrics["mean_output_tokens"] == pytest.approx(sum(wanted) / 6)  # ignore_eos: every token asked for
    assert metrics["num_completed"] == 6 and metrics["workload"]["rate"] == 40
    stats = metrics["system"]
    assert stats["name"] == "servelab" and stats["num_steps"] >= 6
    assert 0 <= stats["kv_waste"] < 1 and stats["kv_peak_reserved_slots"] > 0 and stats["peak_running"] >= 1
    assert metrics["ttft_ms"]["p50"] > 0 and metrics["tpot_ms"]["mean"] > 0


def test_contiguous_cache_wastes_most_of_its_reservations(bench_config, tmp_path):
    cfg = bench_config(*SMALL, "cache=contiguous")
    system = open_system(cfg, str(tmp_path))
    try:
        waste = measure(system, cfg)["system"]["kv_waste"]
    finally:
        system.close()
    assert waste > 0.9  # at most 30 of 512 reserved slots hold a token


def test_capacity_mode_runs_a_bounded_search(bench_config, tmp_path):
    cfg = bench_config(*SMALL, "mode=capacity", "slo.tbt_p99_ms=100000", "mode.rate_low=20",
                       "mode.rate_high=40", "mode.max_iterations=2")
    system = open_system(cfg, str(tmp_path))
    try:
        metrics = measure_capacity(system, cfg)
    finally:
        system.close()
    capacity = metrics["capacity"]
    assert capacity["capacity_rps"] == 40 and capacity["limited_by"] == "rate_high"
    assert [t["rate"] for t in capacity["trials"]] == [20, 40]
    assert metrics["scheduling_delay_ms"]["p50"] >= 0
    assert metrics["workload"]["arrival"] == "poisson" and metrics["workload"]["rate"] == 40
    with pytest.raises(ConfigError, match="slo.tbt_p99_ms"):
        measure_capacity(system, bench_config("mode=capacity"))


def test_transformers_baseline_static_batches(bench_config, tmp_path):
    cfg = bench_config(*SMALL, "baseline=transformers", "baseline.batch_size=4")
    system = open_system(cfg, str(tmp_path))
    metrics = measure(system, cfg)
    wanted = [r.max_tokens for r in build_workload(cfg.workload, system.space)]
    assert metrics["mean_output_tokens"] == pytest.approx(sum(wanted) / 6)
    assert metrics["system"] == {"name": "transformers"} and metrics["num_completed"] == 6
    assert metrics["tpot_ms"]["mean"] > 0 and metrics["itl_ms"]["p50"] > 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_baseline_says_it_is_not_installed(bench_config, tmp_path):
    with pytest.raises(ConfigError, match="baseline=vllm: vLLM is not importable"):
        open_system(bench_config("baseline=vllm"), str(tmp_path))
