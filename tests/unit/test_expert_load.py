"""Expert load: pairs per expert and per expert-parallel rank, the imbalance, counted in
real runs (every pair of every step once)."""

from __future__ import annotations

import pytest

from servelab import LLM, SamplingParams
from servelab.core.expert_load import ExpertLoad
from servelab.testing import mixed_prompts, tiny_checkpoint


def test_load_per_expert_per_rank_and_its_imbalance():
    load = ExpertLoad({1: (6, 2, 0, 0), 3: (2, 2, 2, 2)}, ranks=2)
    assert load.per_expert() == [8, 4, 2, 2] and load.per_rank() == [12, 4]
    # layer 1: ranks hold 8 and 0 pairs (max / mean 2.0); layer 3: 4 and 4 (1.0)
    assert load.imbalance() == pytest.approx(1.5)
    assert ExpertLoad({1: (6, 2, 0, 0)}).imbalance() == pytest.approx(6 * 4 / 8)  # per expert without EP
    since = load - ExpertLoad({1: (1, 1, 0, 0), 3: (2, 2, 2, 2)}, ranks=2)
    assert since.pairs == {1: (5, 1, 0, 0), 3: (0, 0, 0, 0)} and since.imbalance() == pytest.approx(2.0)
    assert ExpertLoad({}).summary() == {"pairs_per_expert": [], "pairs_per_rank": [], "imbalance": None, "layers": []}


@pytest.mark.parametrize("family, sparse_layers", [("qwen2-moe", [1]), ("deepseek-v3", [1]), ("mixtral", [0, 1])])
def test_a_real_run_counts_every_routed_pair_once(tmp_path, family, sparse_layers):
    """Every token a step runs (prompts in chunks, then one per decode) picks top-k experts
    in each sparse layer; the dense layers count none."""
    llm = LLM(tiny_checkpoint(tmp_path / family, family),
              overrides=["model.dtype=float32", "device=cpu", "scheduler=chunked", "scheduler.token_budget=16"])
    prompts = mixed_prompts(257, (5, 30, 12))
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    load = llm.engine.executor.expert_load()
    tokens = sum(map(len, prompts)) + len(prompts) * 5
    assert sorted(load.pairs) == sparse_layers
    assert all(sum(pairs) == 2 * tokens for pairs in load.pairs.values())
    assert load.imbalance() >= 1.0


def test_a_dense_model_reports_no_expert_load(llama):
    assert LLM(llama, overrides=["model.dtype=float32", "device=cpu"]).engine.executor.expert_load() is None

