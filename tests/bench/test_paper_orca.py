"""experiment=orca_iteration_level: a small simulated sweep sustains more with
iteration-level batching than with request-level batches at the same latency bound."""

from __future__ import annotations

import re
import subprocess
import sys


def test_iteration_level_batching_sustains_more(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "from servelab.bench.cli import main; main()", "-m", "experiment=orca_iteration_level",
         "executor=simulated", "use_tqdm=false", "workload.num_requests=48", "mode.max_iterations=4",
         "mode.rate_low=0.1", "mode.rate_high=16", f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "paper.png").stat().st_size > 0
    text = (tmp_path / "paper.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ") for line in text.splitlines()
            if line.startswith(("| static", "| continuous"))}
    assert rows["static"][1] == "8" and rows["continuous"][1] == "256"
    static, continuous = float(rows["static"][4]), float(rows["continuous"][4])
    assert continuous > 2 * static > 0
    gain = float(re.search(r"same latency bound: (?:at least )?\*\*([\d.]+)x\*\*", text).group(1))
    assert gain > 2 and "(Orca: 36.9x" in text
