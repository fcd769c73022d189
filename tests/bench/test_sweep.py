"""A 2-job ``servelab-bench -m`` sweep on the toy model: rows, table and plots."""

from __future__ import annotations

import json
import subprocess
import sys

BENCH = [sys.executable, "-c", "from servelab.bench.cli import main; main()"]


def test_two_job_sweep_writes_rows_table_and_plots(tmp_path):
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [*BENCH, "-m", "model=toy", "scheduler=static,continuous", "workload.num_requests=4",
         "workload.input_range=[8,16]", "workload.output_range=[4,8]", "warmup_requests=1", "use_tqdm=false",
         "torch_threads=1", f"hydra.sweep.dir={sweep}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for job in ("0", "1"):
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        assert metrics["num_completed"] == 4 and metrics["system"]["name"] == "servelab"
        assert metrics["system"]["kv_waste"] is not None and metrics["system"]["peak_running"] >= 1
        assert "scheduler:" in (sweep / job / "config.yaml").read_text()
        assert json.loads((sweep / job / "samples.json").read_text())["itl_ms"]
    rows = [json.loads(line) for line in (sweep / "rows.jsonl").read_text().splitlines()]
    assert [r["job"]["label"] for r in rows] == ["scheduler=static", "scheduler=continuous"]
    table = (sweep / "results.md").read_text()
    assert "| scheduler=static | servelab |" in table and "| scheduler=continuous | servelab |" in table
    for plot in ("throughput_latency.png", "tbt_cdf.png"):
        assert (sweep / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT p50 ms" in result.stdout


def test_config_errors_exit_2_with_the_reason(tmp_path):
    result = subprocess.run([*BENCH, "model=toy", "baseline=transformers", "target=http"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 2
    assert "baseline=transformers runs in this process: use target=inproc" in result.stderr
