"""experiment=sarathi_capacity: every setup composes to its model, split, SLO and scheduler,
and a small simulated sweep reports capacities with chunked prefills ahead of vLLM's policy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servelab.bench.paper_sarathi import bubble_cell, setup_of


@pytest.mark.parametrize("setup, tp, pp, layers, slo, scheduler, knob", [
    ("mistral-7b-strict-sarathi", 1, 1, 32, 100, "chunked", ("token_budget", 512)),
    ("mistral-7b-relaxed-vllm", 1, 1, 32, 500, "continuous", ("mix_prefill_decode", False)),
    ("yi-34b-relaxed-sarathi", 2, 1, 60, 1000, "chunked", ("token_budget", 2048)),
    ("yi-34b-strict-orca", 2, 1, 60, 200, "static", ("max_batch_size", 16)),
    ("falcon-180b-strict-sarathi", 4, 2, 80, 1000, "chunked", ("token_budget", 512)),
    ("falcon-180b-relaxed-vllm", 4, 2, 80, 5000, "continuous", ("mix_prefill_decode", False)),
    ("falcon-180b-relaxed-orca", 4, 2, 80, 5000, "static", ("max_batch_size", 16)),
])
def test_setups_compose(setup, tp, pp, layers, slo, scheduler, knob):
    from omegaconf import OmegaConf

    from servelab.bench.config import store_bench_schemas
    from servelab.core.entrypoints.compose import compose_config
    from servelab.plugins.scheduler.chunked import ChunkedSchedulerConfig
    from servelab.plugins.scheduler.continuous import ContinuousSchedulerConfig
    from servelab.plugins.scheduler.static import StaticSchedulerConfig

    store_bench_schemas()
    cfg = compose_config(["experiment=sarathi_capacity", f"+paper_setup/sarathi_capacity={setup}"], config_name="bench")
    types = {"chunked": ChunkedSchedulerConfig, "continuous": ContinuousSchedulerConfig, "static": StaticSchedulerConfig}
    assert OmegaConf.get_type(cfg.scheduler) is types[scheduler]
    assert cfg.scheduler[knob[0]] == knob[1]
    assert cfg.parallel.tensor_parallel_size == tp and cfg.parallel.pipeline_parallel_size == pp
    assert cfg.slo.tbt_p99_ms == slo and cfg.slo.scheduling_delay_p50_ms == 2000
    assert cfg.model.shape.num_hidden_layers == layers


def test_setup_names_parse():
    row = {"job": {"overrides": ["executor=simulated", "+paper_setup/sarathi_capacity=yi-34b-strict-orca"]}}
    assert setup_of(row) == ("yi-34b", "strict", "orca")


def test_the_pipeline_bubble_is_reported_only_with_pipeline_stages():
    assert bubble_cell({"system": {"stage_bubble_fraction": [0.1, 0.3]}}) == "20.0%"
    assert bubble_cell({"system": {"stage_bubble_fraction": [0.0]}}) == "-" and bubble_cell(None) == "-"


def test_chunked_prefills_raise_capacity(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "from servelab.bench.cli import main; main()", "-m", "experiment=sarathi_capacity",
         "executor=simulated", "use_tqdm=false", "workload.num_requests=128", "mode.max_iterations=5",
         "mode.rate_low=1", "mode.rate_high=6",
         "+paper_setup/sarathi_capacity=mistral-7b-strict-sarathi,mistral-7b-strict-vllm",
         f"hydra.sweep.dir={tmp_path}"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "paper.png").stat().st_size > 0
    (line,) = [line for line in (tmp_path / "paper.md").read_text().splitlines() if line.startswith("| mistral-7b")]
    cells = line.strip("| ").split(" | ")
    vllm, gain = float(cells[5]), float(cells[7])
    assert cells[:4] == ["mistral-7b", "strict", "100", "2000"] and cells[6] == "-"
    assert cells[4] == ">= 6" and 1 < vllm < 6 and gain == pytest.approx(6 / vllm, rel=0.01)   # chunks meet 6/s
    assert "up to 2.6x" in line
