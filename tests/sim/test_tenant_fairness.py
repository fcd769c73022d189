"""Fair sharing on the simulated executor: a tenant that floods the engine."""

from __future__ import annotations

import pytest

from servelab.bench.config import store_bench_schemas
from servelab.bench.runner import measure, open_system
from servelab.core.entrypoints.compose import compose_config

FLOOD = ["model=llama-2-7b", "hardware=a100-80gb", "executor=simulated", "workload=tenants_flood", "use_tqdm=false",
         "warmup_requests=0", "scheduler.max_num_seqs=8", "workload.num_requests=240", "workload.lengths=fixed",
         "workload.input_len=64", "workload.output_len=64", "workload.tenants.flood.rate=40",
         "workload.tenants.steady.rate=8"]
"""Eight sequences at a time (about 10 requests/s at these lengths): flood sends four times
that, steady a bit under it."""


def run(*overrides: str) -> dict:
    """The metrics of one simulated ``servelab-bench`` run."""
    store_bench_schemas()
    cfg = compose_config([*FLOOD, *overrides], config_name="bench")
    system = open_system(cfg, ".")
    try:
        return measure(system, cfg)
    finally:
        system.close()


def test_vtc_shares_service_where_fcfs_follows_the_send_rate():
    fcfs, vtc = run("policy=fcfs"), run("policy=vtc")
    assert fcfs["tenants"]["flood"]["requests"] == 200 and fcfs["tenants"]["steady"]["requests"] == 40
    fcfs_gap = fcfs["fairness"]["service_difference_per_s"]
    vtc_gap = vtc["fairness"]["service_difference_per_s"]
    assert vtc_gap * 4 < fcfs_gap
    assert vtc["fairness"]["jain"] > 0.95 > fcfs["fairness"]["jain"]
    assert vtc["tenants"]["steady"]["ttft_ms"]["p50"] * 4 < fcfs["tenants"]["steady"]["ttft_ms"]["p50"]


def test_deadline_policy_refuses_hopeless_requests_and_counts_them_missed():
    metrics = run("policy=deadline", "+slo_classes.chat={ttft:0.5,tpot:0.1}", "+workload.tenants.steady.slo_class=chat",
                  "+workload.tenants.flood.slo_class=chat")
    chat = metrics["slo_classes"]["chat"]
    refused = sum(t["refused"] for t in metrics["tenants"].values())
    assert refused > 0 and chat["requests"] == 240
    assert chat["met"] <= chat["requests"] - refused
    assert metrics["slo_class_attainment"] == pytest.approx(chat["met"] / 240)
