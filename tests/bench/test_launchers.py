"""``servelab-bench -m`` through Hydra's launchers (docs/parallel.md): jobs run in other
processes give the same sweep report as the default launcher, and failed jobs are named."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.bench.sweep_report import UNFINISHED, collect_jobs

BENCH = [sys.executable, "-c", "from servelab.bench.cli import main; main()"]
# model=tiny: its path is ${servelab_checkpoint:tiny}, a resolver each job's process must know.
SWEEP = ["-m", "model=tiny", "scheduler=continuous,chunked", "workload.num_requests=2",
         "workload.input_range=[8,16]", "workload.output_range=[2,4]", "warmup_requests=0", "use_tqdm=false",
         "torch_threads=1"]
LAUNCHERS = {"joblib": ["hydra/launcher=local_parallel", "hydra.launcher.n_jobs=2"],
             "submitit_local": ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5"]}


def run_sweep(folder: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run ``servelab-bench`` in ``folder`` with the default sweep folder; returns the
    result and the one sweep folder it made (under ``folder``: the default is absolute)."""
    folder.mkdir()
    result = subprocess.run([*BENCH, *overrides], capture_output=True, text=True, timeout=300, cwd=folder)
    sweeps = list(folder.glob("multirun/bench/*/*"))
    assert len(sweeps) == 1, (sweeps, result.stderr[-3000:])
    return result, sweeps[0]


def report(sweep: Path) -> tuple[list[tuple[int, str]], str, list[str]]:
    """The sweep's jobs (number, label), its table's header and the table rows' labels."""
    rows = [json.loads(line) for line in (sweep / "rows.jsonl").read_text().splitlines()]
    table = [line for line in (sweep / "results.md").read_text().splitlines() if line.startswith("| ")]
    return [(r["job"]["num"], r["job"]["label"]) for r in rows], table[0], [line.split(" | ")[0] for line in table[1:]]


@pytest.fixture(scope="module")
def basic_sweep(tmp_path_factory):
    """The two-job sweep through Hydra's default (basic, in-process) launcher."""
    result, sweep = run_sweep(tmp_path_factory.mktemp("basic") / "run", *SWEEP)
    assert result.returncode == 0, result.stderr[-3000:]
    return sweep


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=list(LAUNCHERS))
def test_a_sweep_through_a_launcher_reports_like_the_basic_launcher(launcher, basic_sweep, tmp_path):
    result, sweep = run_sweep(tmp_path / "run", *SWEEP, *LAUNCHERS[launcher])
    assert result.returncode == 0, result.stderr[-3000:]
    jobs, header, labels = report(sweep)
    assert jobs == [(0, "scheduler=continuous"), (1, "scheduler=chunked")]
    assert (jobs, header, labels) == report(basic_sweep)
    for num, _ in jobs:
        metrics = json.loads((sweep / str(num) / "metrics.json").read_text())
        assert metrics["num_completed"] == 2 and metrics["job"]["num"] == num
        assert "checkpoints/tiny" in (sweep / str(num) / "config.yaml").read_text()
    for plot in ("throughput_latency.png", "tbt_cdf.png"):
        assert (sweep / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Failed jobs" not in (sweep / "results.md").read_text()


def test_failed_jobs_are_reported_and_the_sweep_exits_1(tmp_path):
    result, sweep = run_sweep(tmp_path / "run", "-m", "model=toy", "baseline=transformers", "target=http",
                              "workload.num_requests=1,2")
    assert result.returncode == 1, result.stderr[-3000:]
    for num in ("0", "1"):
        error = json.loads((sweep / num / "error.json").read_text())
        assert error["error"].startswith("ConfigError:") and "use target=inproc" in error["error"]
        assert error["job"]["num"] == int(num) and "Traceback" in error["traceback"]
    results = (sweep / "results.md").read_text()
    assert "No job finished." in results and "2 of 2 jobs failed." in results
    assert f"| workload.num_requests=1 | {sweep / '0'} | ConfigError:" in results
    assert "2 job(s) failed: job 0 (workload.num_requests=1): ConfigError:" in result.stderr
    assert (sweep / "rows.jsonl").read_text() == ""


def test_a_job_folder_without_metrics_or_error_is_reported_unfinished(tmp_path):
    done, killed = tmp_path / "0", tmp_path / "1"
    done.mkdir()
    (done / "metrics.json").write_text(json.dumps({"job": {"num": 0, "label": None, "overrides": ["a=1", "b=1"]}}))
    (killed / ".hydra").mkdir(parents=True)
    (killed / ".hydra" / "hydra.yaml").write_text("hydra:\n  job:\n    num: 1\n  overrides:\n    task: [a=1, b=2]\n")
    (tmp_path / ".submitit").mkdir()
    rows, failures = collect_jobs(tmp_path)
    assert [r["job"]["label"] for r in rows] == ["b=1"]
    assert failures == [{"job": {"num": 1, "label": "b=2", "overrides": ["a=1", "b=2"], "dir": str(killed),
                                 "group": "b=2"}, "error": UNFINISHED}]


@pytest.mark.parametrize("preset, fields", [
    ("local_parallel", {"n_jobs": 2}),
    ("slurm_gpu", {"partition": None, "gpus_per_node": 1, "timeout_min": 60, "cpus_per_task": 8, "mem_gb": 64}),
    ("ray_cluster", {"ray": {"init": {"address": "auto"}, "remote": {"num_gpus": 1, "num_cpus": 8}}}),
])
def test_launcher_presets_compose_from_servelab_conf(preset, fields):
    if preset == "ray_cluster" and importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None:
        pytest.skip("hydra-ray-launcher is not installed (servelab[ray-launcher])")
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from servelab.bench.config import store_bench_schemas
    from servelab.core.entrypoints.compose import prepare_hydra

    prepare_hydra()
    store_bench_schemas()
    with initialize_config_module(config_module="servelab.conf", version_base=None):
        cfg = compose("bench", overrides=["model=toy", f"hydra/launcher={preset}"], return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher)
    assert launcher["_target_"].startswith("hydra_plugins.")
    assert OmegaConf.merge(launcher, fields) == launcher
