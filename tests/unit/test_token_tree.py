"""Token trees: the shape rules, a malformed tree refused by name, and a kept path that
is not the first branch moved into place (output still equal to transformers)."""

from __future__ import annotations

import pytest

from servelab import LLM, SamplingParams
from servelab.core.decoding import Proposal
from servelab.core.errors import ProposalError
from servelab.core.token_tree import ancestor_mask, depths, tree_problem
from servelab.testing import mixed_prompts
from servelab.testing.oracle import transformers_greedy

BASE = ["model.dtype=float32", "device=cpu", "cache.block_size=4", "decoding=ngram", "decoding.branches=2"]


@pytest.mark.parametrize("parents, budget, rule", [
    ([1, 0], 4, "nodes 0 -> 1 -> 0 form a cycle"),
    ([0], 4, "nodes 0 -> 0 form a cycle"),
    ([-1, 2, 0], 4, "node 1's parent 2 comes after it"),
    ([-1, -1, -1], 2, "it has 3 nodes, more than the 2 this step allows"),
    ([-1, -3], 4, "node 1's parent -3 is not a node"),
])
def test_each_broken_rule_is_named(parents, budget, rule):
    assert rule in tree_problem(parents, len(parents), budget)


def test_well_formed_trees_pass_and_lay_out_by_depth():
    parents = [-1, -1, 0, 2, 1]
    assert tree_problem(parents, 5, 5) is None
    assert tree_problem(parents, 4, 5).startswith("it gives 5 parents for 4 draft tokens")
    assert depths(parents) == [0, 0, 1, 2, 1]
    assert ancestor_mask(parents)[3].tolist() == [True, False, True, True, False]


def test_a_malformed_tree_is_refused_naming_the_request_and_the_rule(llama):
    llm = LLM(llama, overrides=BASE)
    engine = llm.engine

    def cyclic(batch):
        return Proposal(tuple([7, 8] if n else [] for n in batch.num_draft_tokens),
                        parents=tuple([1, 0] if n else [] for n in batch.num_draft_tokens))

    engine.strategy.propose = cyclic
    request_id = engine.add_request(mixed_prompts(257, lengths=(6,))[0], SamplingParams(temperature=0, max_tokens=5))
    with pytest.raises(ProposalError, match=rf"request '{request_id}'.*NgramDecoding.*nodes 0 -> 1 -> 0 form a cycle"):
        for _ in range(3):
            engine.step()


def test_a_kept_second_branch_is_moved_into_place(llama, step_recorder):
    """Drafts whose first child of the root is wrong and whose second branch is the
    target's continuation: the kept path (nodes 1, 2, 3) is copied to the slots after the
    request's last token, so every later step reads the right keys and values."""
    prompts = mixed_prompts(257, lengths=(5, 13, 9))
    expected = transformers_greedy(llama, prompts, 16)
    futures = {tuple(p): p + e for p, e in zip(prompts, expected)}
    llm = LLM(llama, overrides=BASE)
    recorder = step_recorder(llm.engine)

    def second_branch(batch):
        drafts, parents = [], []
        for request, allowance in zip(batch.requests, batch.num_draft_tokens):
            tokens = request.token_ids
            future = futures[tuple(request.prompt_token_ids)]
            following = future[len(tokens):len(tokens) + 3]
            if allowance < 4 or len(following) < 3:
                drafts.append([])
                parents.append([])
                continue
            drafts.append([(following[0] + 1) % 257, *following])
            parents.append([-1, -1, 1, 2])
        return Proposal(tuple(drafts), parents=tuple(parents))

    llm.engine.strategy.propose = second_branch
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    verified = [s for s in recorder.stats if s.spec_proposed]
    assert verified and sum(s.spec_accepted for s in verified) == 3 * sum(s.spec_proposed for s in verified) // 4
    assert llm.engine.cache.usage.used_blocks == 0


def test_trees_are_refused_at_start_for_a_sliding_window(tmp_path):
    from servelab.core.errors import ConfigError
    from servelab.testing import tiny_checkpoint

    folder = tiny_checkpoint(tmp_path / "windowed", "mistral", sliding_window=8)
    with pytest.raises(ConfigError, match="NgramDecoding: token trees need a model whose layers all attend"):
        LLM(folder, overrides=BASE)
    LLM(folder, overrides=[*BASE[:-1], "decoding.branches=1"]).shutdown()  # chains are fine
