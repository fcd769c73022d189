"""Token trees under executor=simulated: the path kept is drawn from the per-depth, per-rank
acceptance table (``executor.tree_acceptance``), its mean matches the table's expectation,
and a tree of N nodes is verified, and priced, as N tokens."""

from __future__ import annotations

from random import Random

import pytest

from servelab import ConfigError, LLM, SamplingParams
from servelab.plugins.executor.simulated_tree import TreeAcceptance

LLAMA_7B = ["model=llama-2-7b", "hardware=a100-80gb", "executor=simulated", "cost_model=roofline",
            "decoding=speculative", "decoding.draft=llama-draft-106m"]
TABLE = "executor.tree_acceptance=[[0.6,0.2,0.1],[0.5,0.2],[0.4,0.1]]"
TREE = "decoding.tree=[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,0,0]]"


def run(*overrides: str) -> tuple[float, float]:
    """16 requests of 200 tokens at batch 16 (over 1,000 verifications): tokens per step
    (1 + kept drafts per verification) and the virtual seconds each verification step took."""
    llm = LLM(overrides=[*LLAMA_7B, "scheduler.max_num_seqs=16", *overrides])
    outputs = llm.generate([[1] * 64] * 16, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    proposed = sum(o.metrics.spec_proposed_tokens for o in outputs)
    accepted = sum(o.metrics.spec_accepted_tokens for o in outputs)
    nodes = llm.engine.strategy.num_lookahead_tokens
    steps = proposed / nodes
    decode = sum(o.metrics.token_times[-1] - o.metrics.token_times[0] for o in outputs) / len(outputs)
    return 1 + accepted / steps, decode / (steps / len(outputs))


def test_drawn_paths_match_the_tables_expectation():
    acceptance = TreeAcceptance([[0.6, 0.2, 0.1], [0.5, 0.2], [0.4, 0.1]])
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]
    # 0.6 + 0.2 + 0.1 + 0.6*0.5 + 0.6*0.2 + 0.2*0.5 + 0.6*0.5*0.4 + 0.6*0.5*0.4*0.4 = 1.588
    assert acceptance.expected_kept(paths) == pytest.approx(1.588)
    random = Random(1)
    draws = [acceptance.draw(set(paths), random) for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(1.588, abs=0.03)
    chain = [(0,) * d for d in range(1, 9)]
    assert acceptance.expected_kept(chain) < acceptance.expected_kept(paths)


def test_engine_tree_keeps_the_expected_path_and_costs_more_than_a_shorter_chain():
    tree_tokens, tree_step = run(TABLE, TREE)
    chain_tokens, chain_step = run(TABLE, "decoding.num_speculative_tokens=3")
    assert tree_tokens == pytest.approx(1 + 1.588, abs=0.08)
    # a chain of 3: 0.6 + 0.6*0.5 + 0.6*0.5*0.4 = 1.02
    assert chain_tokens == pytest.approx(1 + 1.02, abs=0.08)
    assert tree_step > chain_step          # 8 verified nodes (and 4 draft levels) against 3


def test_default_table_keeps_a_chain_at_the_rate_and_tries_siblings():
    tokens, _ = run("decoding.simulated_acceptance_rate=0.5", "decoding.tree=[[0],[1],[0,0]]")
    # a (1 - a)^r: 0.5 + 0.25 + 0.5 * 0.5 = 1.0 kept
    assert tokens == pytest.approx(2.0, abs=0.08)


@pytest.mark.parametrize("table, message", [("[]", "at least one depth"), ("[[0.8,0.3]]", "sum to at most 1")])
def test_bad_tables_are_refused(table, message):
    with pytest.raises(ConfigError, match=message):
        LLM(overrides=[*LLAMA_7B, f"executor.tree_acceptance={table}"])
