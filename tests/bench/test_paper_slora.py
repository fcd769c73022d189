"""Adapters in simulated benchmarks: ``workload.num_adapters`` adapters without weights
drawn by popularity, ``system.lora`` as a real run reports it, and experiment=slora's
comparison (batched against merging one adapter at a time)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from random import Random
from types import SimpleNamespace

import pytest

from servelab import ConfigError
from servelab.bench.adapter_popularity import adapter_draw, adapter_names


def counts(popularity: str, alpha: float, n: int = 10, draws: int = 4000) -> list[int]:
    cfg = SimpleNamespace(num_adapters=n, adapter_popularity=popularity, adapter_alpha=alpha)
    draw = adapter_draw(cfg, adapter_names(cfg), Random(0))
    seen = Counter(draw() for _ in range(draws))
    return [seen[f"adapter{i}"] for i in range(n)]


def test_popularity_uniform_zipf_and_slora_power():
    for popularity, alpha in (("uniform", 1.0), ("power", 1.0), ("zipf", 0.0)):
        assert min(counts(popularity, alpha)) > 300  # about 400 each
    zipf = counts("zipf", 1.0)
    assert zipf[0] == max(zipf) and zipf[0] > 3 * zipf[-1]
    power = counts("power", 0.3)  # floor(10 x), x = u^(1/0.3): half the draws below 0.1^0.3 ... ~ the first
    assert power[0] > 0.45 * 4000 and power == sorted(power, reverse=True)
    with pytest.raises(ConfigError, match="adapter_popularity"):
        counts("popular", 1.0)
    with pytest.raises(ConfigError, match="adapter_alpha"):
        counts("power", 0.0)
    with pytest.raises(ConfigError, match="num_adapters"):
        adapter_names(SimpleNamespace(adapters=["a"], num_adapters=2))


def test_the_preset_writes_the_comparison(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "from servelab.bench.cli import main; main()", "-m", "experiment=slora",
         "use_tqdm=false", "workload.num_requests=12", "workload.input_range=[8,32]", "workload.output_range=[8,16]",
         "workload.num_adapters=20", f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "paper.png").stat().st_size > 0
    lines = [line.strip("| ").split(" | ") for line in (tmp_path / "paper.md").read_text().splitlines()
             if line.startswith("| 20 |")]
    assert len(lines) == 1
    adapters, batched, merged, ratio, hit, load_ms, *_ = lines[0]
    assert float(batched) > float(merged) and float(ratio) > 1
    assert 0 < float(hit) <= 100 and float(load_ms) > 0
