"""servelab-bench's ``system.experts``: the expert load of the measured requests alone."""

from __future__ import annotations

from servelab.testing import tiny_checkpoint


def test_servelab_bench_reports_the_measured_requests_expert_load(tmp_path, bench_config):
    from servelab.bench.report import format_value, summary_table
    from servelab.bench.runner import measure
    from servelab.bench.targets.inproc import ServelabSystem

    folder = tiny_checkpoint(tmp_path / "qwen3-moe", "qwen3-moe")
    cfg = bench_config("model=local", f"model.path={folder}", "model.dtype=float32", "device=cpu",
                       "workload.num_requests=4", "workload.input_range=[8,8]", "workload.output_range=[3,3]",
                       "warmup_requests=1")
    system = ServelabSystem(cfg)
    try:
        metrics = measure(system, cfg)
    finally:
        system.close()
    experts = metrics["system"]["experts"]
    # four requests of 8 prompt tokens and 2 more steps each, top-2, both layers sparse
    assert sum(experts["pairs_per_expert"]) == 4 * (8 + 2) * 2 * 2
    assert experts["pairs_per_rank"] == [sum(experts["pairs_per_expert"])] and experts["layers"] == [0, 1]
    assert f"expert imbalance  {format_value(experts['imbalance'])}" in summary_table(metrics)
