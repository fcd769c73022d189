"""experiment=vllm_paper: the setups compose to the paper's caches and lengths, and a small
simulated sweep sustains more requests with the paged cache than with Orca-Max's reservations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servelab.bench.paper_vllm import setup_of


def compose(*overrides: str):
    from servelab.bench.config import store_bench_schemas
    from servelab.core.entrypoints.compose import compose_config

    store_bench_schemas()
    return compose_config(["experiment=vllm_paper", *overrides], config_name="bench")


@pytest.mark.parametrize("system, cache, reservation", [
    ("vllm", "paged", None), ("orca-oracle", "contiguous", "oracle"), ("orca-pow2", "contiguous", "pow2"),
    ("orca-max", "contiguous", "max")])
def test_systems_compose(system, cache, reservation):
    from servelab.core.engine.registry import get_registry

    cfg = compose("+paper_setup/vllm_paper_workload=alpaca", f"+paper_setup/vllm_paper_system={system}")
    assert get_registry().spec_for_config("cache", cfg.cache).name == cache
    assert cfg.cache.get("reservation") == reservation
    assert cfg.workload.sharegpt.input_mean == 19.31 and cfg.workload.sharegpt.output_mean == 58.45
    assert cfg.model.shape.hidden_size == 5120 and cfg.hardware.name == "a100-40gb"
    assert cfg.slo.normalized_latency_ms is not None and cfg.slo.tbt_p99_ms is None


def test_setup_names_parse():
    row = {"job": {"overrides": ["+paper_setup/vllm_paper_workload=sharegpt", "+paper_setup/vllm_paper_system=orca-max"]}}
    assert setup_of(row) == ("sharegpt", "orca-max")


def test_the_paged_cache_sustains_more(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "from servelab.bench.cli import main; main()", "-m", "experiment=vllm_paper",
         "executor=simulated", "use_tqdm=false", "workload.num_requests=48", "mode.max_iterations=4",
         "mode.rate_low=1", "mode.rate_high=64", "+paper_setup/vllm_paper_workload=alpaca",
         "+paper_setup/vllm_paper_system=vllm,orca-max", f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "paper.png").stat().st_size > 0
    (line,) = [line for line in (tmp_path / "paper.md").read_text().splitlines() if line.startswith("| alpaca")]
    cells = line.strip("| ").split(" | ")
    paged, orca_max = float(cells[2].removeprefix(">= ")), float(cells[5])
    assert cells[3] == cells[4] == "-" and paged > orca_max > 0
    ratio = cells[7].removeprefix(">= " if cells[2].startswith(">= ") else "")
    assert float(ratio) == pytest.approx(paged / orca_max, rel=0.01)
    paged_share, max_share = float(cells[9]), float(cells[12])
    assert paged_share > 80 and max_share < 50    # 16-token blocks: short Alpaca sequences waste ~10%
