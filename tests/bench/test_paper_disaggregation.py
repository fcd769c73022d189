"""experiment=distserve and experiment=splitwise: every setup composes to its pools, the
goodput at 90% attainment is read off the rate curve, and small sweeps write the reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.bench.paper_distserve import DistServeReport
from servelab.bench.paper_splitwise import cost
from servelab.bench.slo_goodput import cell, rate_at_attainment, setup_name

BENCH = [sys.executable, "-c", "from servelab.bench.cli import main; main()"]


def compose(*overrides: str):
    from servelab.bench.config import store_bench_schemas
    from servelab.core.entrypoints.compose import compose_config

    store_bench_schemas()
    return compose_config(list(overrides), config_name="bench")


DISTSERVE_SETUPS = sorted(p.stem for p in (Path(__file__).parents[2] / "conf/experiment/distserve_setup").glob("*.yaml"))


def test_the_distserve_sweep_runs_every_setup():
    from omegaconf import OmegaConf

    sweep = OmegaConf.load(Path(__file__).parents[2] / "conf/experiment/distserve.yaml").hydra.sweeper.params
    assert sorted(sweep["+experiment/distserve_setup"].split(",")) == DISTSERVE_SETUPS and len(DISTSERVE_SETUPS) == 11


# setup -> (layers, TTFT / TPOT SLO ms, lengths, per-GPU base rate, GPUs, prefill (instances, tp, pp), decode)
DISTSERVE = {
    "opt-13b-chatbot-vllm": (40, (250, 100), "sharegpt", 4, 1, None, None),
    "opt-13b-chatbot-distserve": (40, (250, 100), "sharegpt", 4, 3, (1, 2, 1), (1, 1, 1)),
    "opt-13b-chatbot-2p1d": (40, (250, 100), "sharegpt", 4, 3, (2, 1, 1), (1, 1, 1)),
    "opt-66b-chatbot-vllm": (64, (2500, 150), "sharegpt", 1, 4, None, None),
    "opt-66b-chatbot-distserve": (64, (2500, 150), "sharegpt", 1, 8, (1, 4, 1), (1, 2, 2)),
    "opt-175b-chatbot-vllm": (96, (4000, 200), "sharegpt", 0.4, 8, None, None),
    "opt-175b-chatbot-distserve": (96, (4000, 200), "sharegpt", 0.4, 21, (1, 3, 3), (1, 4, 3)),
    "opt-66b-code-vllm": (64, (125, 200), "uniform", 1, 4, None, None),
    "opt-66b-code-distserve": (64, (125, 200), "uniform", 1, 8, (1, 4, 1), (1, 2, 2)),
    "opt-66b-summarization-vllm": (64, (15000, 150), "uniform", 0.25, 4, None, None),
    "opt-66b-summarization-distserve": (64, (15000, 150), "uniform", 0.25, 8, (1, 4, 1), (1, 2, 2)),
}


def pool_split(pool) -> tuple[int, int, int]:
    """(instances, tp, pp) of a pool from its overrides."""
    found = dict(o.split("=", 1) for o in pool.overrides)
    return (pool.instances, int(found.get("parallel.tensor_parallel_size", 1)),
            int(found.get("parallel.pipeline_parallel_size", 1)))


@pytest.mark.parametrize("setup", DISTSERVE_SETUPS)
def test_distserve_setups_compose(setup):
    layers, slo, lengths, base, count, prefill, decode = DISTSERVE[setup]
    cfg = compose("experiment=distserve", f"+experiment/distserve_setup={setup}", "+distserve.load=2")
    assert cfg.hardware.name == "a100-80gb" and cfg.model.shape.num_hidden_layers == layers
    assert (cfg.slo.ttft_ms, cfg.slo.tpot_ms) == slo and cfg.workload.lengths == lengths
    assert cfg.workload.num_requests == 512 and cfg.workload.rate == pytest.approx(2 * base * count)
    if prefill is None:
        assert cfg.deployment.name == "single" and cfg.parallel.tensor_parallel_size == count
    else:
        assert cfg.deployment.name == "disaggregated" and cfg.deployment.link == "nvlink"
        assert (pool_split(cfg.deployment.prefill), pool_split(cfg.deployment.decode)) == (prefill, decode)
        assert sum(n * tp * pp for n, tp, pp in (prefill, decode)) == count


@pytest.mark.parametrize("model, billions, splits", [("opt-66b", 65.7, [(4, 1), (2, 2)]),
                                                    ("opt-175b", 175, [(8, 1), (3, 3), (4, 3)])])
def test_opt_shapes_hold_their_weights_and_divide_among_the_papers_splits(model, billions, splits):
    from servelab.core.model import ModelShape

    s = compose(f"model={model}").model.shape
    shape = ModelShape(s.num_hidden_layers, s.num_attention_heads, s.num_key_value_heads,
                       s.hidden_size // s.num_attention_heads, None, s.max_position_embeddings, s.vocab_size,
                       s.hidden_size, s.intermediate_size, s.tie_word_embeddings)
    assert shape.vocab_size == 50272 and shape.num_parameters / 1e9 == pytest.approx(billions, rel=0.01)
    assert all(not shape.parallel_problems(tp, pp) for tp, pp in splits)


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
    row = {"job": {"overrides": ["+distserve.load=2", "+experiment/distserve_setup=opt-13b-chatbot-2p1d"]}}
    assert setup_name(row, "experiment/distserve_setup") == "opt-13b-chatbot-2p1d"


def test_a_setups_cost_counts_its_machines():
    pools = {"prefill": {"instances": 1, "tensor_parallel_size": 8, "pipeline_parallel_size": 1, "hardware": "h100-80gb"},
             "decode": {"instances": 2, "tensor_parallel_size": 8, "pipeline_parallel_size": 1, "hardware": "a100-80gb"}}
    assert cost({"system": {"pools": pools}}) == pytest.approx(38.0 + 2 * 17.6)


def synthetic_job(folder: Path, num: int, setup: str, rate: float, attainment: float, slowdown: float,
                  pools=None, tp: int = 1):
    """A finished job's row, with the config and samples the report reads: ten requests
    whose TTFT over the SLO is ``slowdown`` x 0.1 ... 1.0 (so scale 0.91 x ``slowdown``
    meets 90%)."""
    folder.mkdir()
    (folder / "config.yaml").write_text(f"slo: {{ttft_ms: 125, tpot_ms: 200}}\n"
                                        f"parallel: {{tensor_parallel_size: {tp}, pipeline_parallel_size: 1}}\n"
                                        f"target: {{replicas: 1}}\nhardware: {{name: a100-80gb}}\n")
    ttft = [125 * slowdown * (i + 1) / 10 for i in range(10)]
    (folder / "samples.json").write_text(json.dumps({"ttft_ms": ttft, "tpot_ms": [1.0] * 10}))
    system = {"name": "servelab-disaggregated" if pools else "servelab"}
    if pools:
        system["pools"] = pools
    return {"job": {"num": num, "dir": str(folder), "overrides": [f"+experiment/distserve_setup={setup}"]},
            "workload": {"rate": rate}, "slo_attainment": attainment, "system": system}


def test_the_distserve_table_puts_each_cells_goodput_and_slo_scale_beside_the_papers(tmp_path):
    pools = {"prefill": {"instances": 1, "tensor_parallel_size": 4, "pipeline_parallel_size": 1, "hardware": "a100-80gb"},
             "decode": {"instances": 1, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "hardware": "a100-80gb"}}
    rows = [synthetic_job(tmp_path / "0", 0, "opt-66b-code-vllm", 4.0, 1.0, 1.0, tp=4),
            synthetic_job(tmp_path / "1", 1, "opt-66b-code-vllm", 8.0, 0.8, 2.0, tp=4),
            synthetic_job(tmp_path / "2", 2, "opt-66b-code-distserve", 8.0, 1.0, 0.5, pools),
            synthetic_job(tmp_path / "3", 3, "opt-66b-code-distserve", 16.0, 0.95, 0.5, pools)]
    text = DistServeReport().table(rows)
    # vLLM: 1 req/s/GPU at 100%, 2 at 80%: 90% at 1.5; the pools meet it at every rate (>= 2).
    assert "| opt-66b-code | vllm | 4 | TP4 | 0.125 / 0.2 | 1.5 | 1.00x |" in text
    assert "| opt-66b-code | distserve | 8 | 1x TP4 + 1x TP2xPP2 | 0.125 / 0.2 | >= 2 | >= 1.33x | 5.7x | 2.00x at 1 | 1.4x |" in text
    # The SLO scales: 0.91 and 1.82 for vLLM, 0.455 for the pools; the headline is at the
    # highest rate where vLLM's own scale is at most 1.
    assert "| opt-66b-code | distserve | 1 | 0.91 | 0.455 | 2.00x |" in text and "12.6x" in text
    assert "| opt-66b-code | distserve | 2 | 1.82 | 0.455 | 4.00x |" in text
    assert "- opt-66b-code-distserve: 1: 100.0%, 2: 95.0%" in text


def test_a_small_distserve_sweep_writes_the_comparison(tmp_path):
    result = subprocess.run(
        [*BENCH, "-m", "experiment=distserve", "workload.num_requests=24", "+distserve.load=1",
         "+experiment/distserve_setup=opt-66b-code-vllm,opt-66b-code-distserve", "use_tqdm=false",
         f"hydra.sweep.dir={tmp_path}"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = (tmp_path / "paper.md").read_text()
    assert "| opt-66b-code | vllm | 4 | TP4 |" in text and "| opt-66b-code | distserve | 8 | 1x TP4 + 1x TP2xPP2 |" in text
    assert "- opt-66b-code-distserve: 1: " in text and (tmp_path / "paper.png").stat().st_size > 0


def test_a_small_splitwise_sweep_writes_the_comparison(tmp_path):
    result = subprocess.run(
        [*BENCH, "-m", "experiment=splitwise", "workload.num_requests=16", "workload.trace_rate=4", "warmup_requests=0",
         "+experiment/splitwise_setup=baseline-h100,splitwise-ha", "use_tqdm=false", f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = (tmp_path / "paper.md").read_text()
    assert "| baseline-h100 | 8 h100-80gb | 304 |" in text
    assert "| splitwise-ha | 6 h100-80gb + 4 a100-80gb | 298 |" in text and "2.35x" in text
