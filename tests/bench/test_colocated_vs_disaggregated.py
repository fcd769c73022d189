"""experiment=colocated_vs_disaggregated: every scenario and system composes to four
instances of its split, margins carry their bounds, and a small sweep writes a table and
figure with a winner per cell whose goodputs agree with the jobs' own metrics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from servelab.bench.paper_colocated_vs_disaggregated import (DESIGNS, ColocatedVsDisaggregatedReport, Goodput,
                                                           attainment, design_of, margin)
from servelab.bench.sweep_report import collect_jobs

BENCH = [sys.executable, "-c", "from servelab.bench.cli import main; main()"]
CONF = Path(__file__).resolve().parents[2] / "conf" / "experiment"
SCALES = {"tight": 0.5, "medium": 1.0, "loose": 2.0}


def compose(*overrides: str):
    from servelab.bench.config import store_bench_schemas
    from servelab.core.entrypoints.compose import compose_config

    store_bench_schemas()
    return compose_config(list(overrides), config_name="bench")


def test_the_sweep_runs_every_scenario_and_system_at_equal_gpus():
    params = OmegaConf.load(CONF / "colocated_vs_disaggregated.yaml").hydra.sweeper.params
    for group in ("scenario", "system"):
        swept = params[f"+experiment/colocated_vs_disaggregated_{group}"].split(",")
        assert sorted(swept) == sorted(p.stem for p in (CONF / f"colocated_vs_disaggregated_{group}").glob("*.yaml"))
    for system in params["+experiment/colocated_vs_disaggregated_system"].split(","):
        for scenario, split in (("llama-2-7b-chat", 1), ("llama-2-70b-summarize", 4)):
            cfg = compose("experiment=colocated_vs_disaggregated", f"+experiment/colocated_vs_disaggregated_scenario={scenario}",
                          f"+experiment/colocated_vs_disaggregated_system={system}")
            instances = (cfg.deployment.prefill.instances + cfg.deployment.decode.instances
                         if cfg.deployment.name == "disaggregated" else cfg.target.replicas)
            assert instances == 4 and cfg.parallel.tensor_parallel_size == split
            assert cfg.hardware.name == "a100-80gb"
            assert cfg.slo.ttft_ms > 0 and cfg.slo.tpot_ms > 0 and cfg.workload.output_range[0] >= 2
            assert design_of(system) in DESIGNS


def test_a_margin_is_a_bound_when_a_goodput_lies_outside_the_rates():
    assert design_of("3p1d") == "disaggregated" and design_of("chunked") == "chunked" and design_of("vllm") == "vllm"
    assert margin(Goodput(3.0, "", "vllm"), Goodput(1.5, "", "2p2d")) == (pytest.approx(2.0), "")
    assert margin(Goodput(3.0, "", "vllm"), Goodput(1.0, "<", "2p2d")) == (pytest.approx(3.0), ">")
    assert margin(Goodput(8.0, ">=", "vllm"), Goodput(2.0, "", "chunked")) == (pytest.approx(4.0), ">")
    assert margin(Goodput(8.0, ">=", "vllm"), Goodput(8.0, ">=", "chunked")) == (None, "")
    assert Goodput(1.0, "<", "vllm").rank < Goodput(0.5, "", "chunked").rank


def test_a_small_sweep_writes_a_winner_per_cell(tmp_path):
    result = subprocess.run(
        [*BENCH, "-m", "experiment=colocated_vs_disaggregated", "workload.num_requests=48", "workload.rate=2,128",
         "+experiment/colocated_vs_disaggregated_scenario=llama-2-7b-summarize",
         "+experiment/colocated_vs_disaggregated_system=chunked,vllm,2p2d", "use_tqdm=false",
         f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = (tmp_path / "paper.md").read_text()
    assert (tmp_path / "paper.png").stat().st_size > 0
    assert "| llama-2-7b | 4 | summarize | " in text and "Every system's goodput" in text and "- llama-2-7b-summarize 2p2d: 2: " in text

    rows, failures = collect_jobs(tmp_path)
    assert len(rows) == 6 and not failures
    for row in rows:
        assert attainment(row, 1.0) == pytest.approx(row["slo_attainment"])
    report = ColocatedVsDisaggregatedReport(SCALES)
    cells = report.cells(rows)
    assert [c.scale_name for c in cells] == list(SCALES)
    for c in cells:
        assert set(c.best) == set(DESIGNS) and c.winner in DESIGNS, c
        assert c.ratio is not None and c.ratio >= 1.0
        winner = c.best[c.winner]
        assert winner.value > 0 and all(winner.rank >= g.rank for g in c.best.values())
        assert f"| {c.scale_name} | {c.ttft_ms:g} / {c.tpot_ms:g} |" in text
    for runs in report.scenarios(rows)[("llama-2-7b", "summarize")].values():
        found = report.goodputs(runs)
        assert found["tight"].value > 0 and found["tight"].rank <= found["medium"].rank <= found["loose"].rank
