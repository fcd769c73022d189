"""experiment=spec_decode_theory: Leviathan et al.'s formulas, k = 0 as the plain baseline,
and the paper report of a small simulated sweep."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from servelab import LLM, SamplingParams
from servelab.bench.paper_spec_decode import expected_speedup, expected_tokens

LLAMA_7B = ["model=llama-2-7b", "hardware=a100-80gb", "executor=simulated", "cost_model=roofline"]


def test_the_formulas():
    assert expected_tokens(0.8, 0) == 1.0
    assert expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_speedup(0.8, 3, 0.05) == pytest.approx(2.952 / 1.15)
    assert expected_speedup(0.6, 0, 0.05) == 1.0


def test_zero_drafts_is_plain_decoding_in_simulation():
    prompts, params = [[1] * 64] * 2, SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(overrides=LLAMA_7B).generate(prompts, params, use_tqdm=False)
    zero = LLM(overrides=[*LLAMA_7B, "decoding=speculative", "decoding.draft=llama-draft-106m",
                          "decoding.num_speculative_tokens=0"]).generate(prompts, params, use_tqdm=False)
    assert [o.metrics.token_times for o in zero] == [o.metrics.token_times for o in plain]
    assert all(o.metrics.spec_proposed_tokens == 0 for o in zero)


def test_zero_drafts_reproduces_greedy_with_the_real_executor():
    prompts = [[5, 17, 33, 8, 90, 12], [7, 7, 3]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    greedy = LLM("tiny", overrides=["device=cpu"]).generate(prompts, params, use_tqdm=False)
    zero = LLM("tiny", overrides=["device=cpu", "decoding=speculative", "decoding.num_speculative_tokens=0"]).generate(
        prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in zero] == [o.outputs[0].token_ids for o in greedy]


def test_the_draft_costs_a_twentieth_of_the_target():
    from servelab.core.cost_model import BatchShape

    llm = LLM(overrides=[*LLAMA_7B, "decoding=speculative", "decoding.draft=llama-draft-106m"])
    executor = llm.engine.executor
    step = BatchShape((1,), (512,), 1)
    ratio = executor.draft_cost_model.forward_cost(step).total / executor.cost_model.forward_cost(step).total
    assert 0.045 < ratio < 0.055


def test_the_preset_writes_the_comparison(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "from servelab.bench.cli import main; main()", "-m", "experiment=spec_decode_theory",
         "executor=simulated", "use_tqdm=false", "workload.num_requests=4", "workload.output_range=[128,128]",
         "decoding.simulated_acceptance_rate=0.8",
         "decoding.num_speculative_tokens=0,1,4", f"hydra.sweep.dir={tmp_path}"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "paper.png").stat().st_size > 0
    lines = [line for line in (tmp_path / "paper.md").read_text().splitlines() if line.startswith("| 0.8 |")]
    assert [line.split(" | ")[1] for line in lines] == ["0", "1", "4"]
    cells = [[float(c) if c != "-" else None for c in line.strip("| ").split(" | ")] for line in lines]
    for a, k, e_formula, e_ours, s_formula, s_ours, cost, _ in cells:
        assert e_ours == pytest.approx(e_formula, rel=0.1)
        assert s_ours == pytest.approx(s_formula, rel=0.1)
        assert cost is None if k == 0 else 0.045 < cost < 0.065
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert all(row["simulated"] for row in rows)
