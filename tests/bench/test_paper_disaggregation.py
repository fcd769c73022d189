"""experiment=distserve and experiment=splitwise: every setup composes to its pools, the
goodput at 90% attainment is read off the rate curve, and small sweeps write the reports."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servelab.bench.paper_splitwise import cost
from servelab.bench.slo_goodput import cell, rate_at_attainment, setup_name

BENCH = [sys.executable, "-c", "from servelab.bench.cli import main; main()"]


def compose(*overrides: str):
    from servelab.bench.config import store_bench_schemas
    from servelab.core.entrypoints.compose import compose_config

    store_bench_schemas()
    return compose_config(list(overrides), config_name="bench")


@pytest.mark.parametrize("setup, deployment, prefill, decode", [
    ("opt-13b-vllm", "single", None, None), ("opt-13b-1p1d", "disaggregated", 1, 1),
    ("opt-13b-2p1d", "disaggregated", 2, 1)])
def test_distserve_setups_compose(setup, deployment, prefill, decode):
    cfg = compose("experiment=distserve", f"+experiment/distserve_setup={setup}")
    assert cfg.deployment.name == deployment and cfg.hardware.name == "a100-80gb"
    assert cfg.model.shape.num_hidden_layers == 40 and (cfg.slo.ttft_ms, cfg.slo.tpot_ms) == (250, 100)
    if prefill is not None:
        assert (cfg.deployment.prefill.instances, cfg.deployment.decode.instances) == (prefill, decode)
        assert cfg.deployment.link == "nvlink"


@pytest.mark.parametrize("setup, hardware, replicas, deployment, decode_overrides", [
    ("baseline-h100", "h100-80gb", 8, "single", None), ("baseline-a100", "a100-80gb", 17, "single", None),
    ("splitwise-hh", "h100-80gb", 1, "disaggregated", []),
    ("splitwise-ha", "h100-80gb", 1, "disaggregated", ["hardware=a100-80gb"]),
    ("splitwise-aa", "a100-80gb", 1, "disaggregated", [])])
def test_splitwise_setups_compose(setup, hardware, replicas, deployment, decode_overrides):
    cfg = compose("experiment=splitwise", f"+experiment/splitwise_setup={setup}")
    assert cfg.hardware.name == hardware and cfg.target.replicas == replicas and cfg.deployment.name == deployment
    assert cfg.parallel.tensor_parallel_size == 8 and cfg.model.shape.num_hidden_layers == 80
    if decode_overrides is not None:
        assert list(cfg.deployment.decode.overrides) == decode_overrides and cfg.deployment.link == "infiniband"


def test_goodput_is_interpolated_where_attainment_crosses_the_target():
    assert rate_at_attainment([(1, 1.0), (2, 0.95), (4, 0.85)]) == (pytest.approx(3.0), "")
    assert rate_at_attainment([(1, 0.99), (2, 0.97)]) == (2, ">=")
    assert rate_at_attainment([(1, 0.5), (2, 0.2)]) == (1, "<")
    assert rate_at_attainment([]) == (None, "")
    assert cell(2.0, ">=") == ">= 2" and cell(None, "") == "-"
    row = {"job": {"overrides": ["workload.rate=2", "+experiment/distserve_setup=opt-13b-2p1d"]}}
    assert setup_name(row, "experiment/distserve_setup") == "opt-13b-2p1d"


def test_a_setups_cost_counts_its_machines():
    pools = {"prefill": {"instances": 1, "tensor_parallel_size": 8, "pipeline_parallel_size": 1, "hardware": "h100-80gb"},
             "decode": {"instances": 2, "tensor_parallel_size": 8, "pipeline_parallel_size": 1, "hardware": "a100-80gb"}}
    assert cost({"system": {"pools": pools}}) == pytest.approx(38.0 + 2 * 17.6)


def test_a_small_distserve_sweep_writes_the_comparison(tmp_path):
    result = subprocess.run(
        [*BENCH, "-m", "experiment=distserve", "workload.num_requests=48", "workload.rate=2,4", "warmup_requests=0",
         "+experiment/distserve_setup=opt-13b-vllm,opt-13b-2p1d", "use_tqdm=false", f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = (tmp_path / "paper.md").read_text()
    assert "| opt-13b | vllm | 1 |" in text and "| opt-13b | 2p1d | 3 |" in text and "7.4x" in text
    assert "- opt-13b-2p1d: 2: " in text and (tmp_path / "paper.png").stat().st_size > 0


def test_a_small_splitwise_sweep_writes_the_comparison(tmp_path):
    result = subprocess.run(
        [*BENCH, "-m", "experiment=splitwise", "workload.num_requests=16", "workload.trace_rate=4", "warmup_requests=0",
         "+experiment/splitwise_setup=baseline-h100,splitwise-ha", "use_tqdm=false", f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = (tmp_path / "paper.md").read_text()
    assert "| baseline-h100 | 8 h100-80gb | 304 |" in text
    assert "| splitwise-ha | 6 h100-80gb + 4 a100-80gb | 298 |" in text and "2.35x" in text
