"""decoding=eagle: the head reads the target's hidden states of the kept tokens (equal to
transformers' last hidden state), drafts that keep greedy output equal to transformers
under prefix caching and chunked prefill, and a head of another shape is refused."""

from __future__ import annotations

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.core.errors import ConfigError
from servelab.testing import assert_engine_matches_transformers, mixed_prompts
from servelab.testing.eagle_head import random_eagle_head

BASE = ["model.dtype=float32", "device=cpu", "cache.block_size=4", "decoding=eagle"]


@pytest.fixture(scope="module")
def head(llama) -> str:
    """A random head beside the tiny Llama (where decoding=eagle looks by default)."""
    return random_eagle_head(llama)


def test_head_gets_the_targets_last_hidden_states_of_kept_tokens(llama, head):
    from transformers import AutoModelForCausalLM

    llm = LLM(llama, overrides=[*BASE, "scheduler=chunked", "scheduler.token_budget=12", "decoding.tree_nodes=5"])
    strategy = llm.engine.strategy
    states: dict[str, dict[int, torch.Tensor]] = {}
    observe = strategy.observe_hidden_states

    def recorded(hidden):
        offset = 0
        for request, first, count in zip(hidden.requests, hidden.first_positions, hidden.counts):
            for k in range(count):
                states.setdefault(request.request_id, {})[first + k] = hidden.states[offset + k].clone()
            offset += count
        observe(hidden)

    strategy.observe_hidden_states = recorded
    prompts = mixed_prompts(llm.engine.vocab_size, lengths=(15, 5))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    for output in outputs:
        tokens = output.prompt_token_ids + output.outputs[0].token_ids
        with torch.no_grad():
            expected = model.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        got = states[output.request_id]
        assert sorted(got) == list(range(len(tokens) - 1))
        torch.testing.assert_close(torch.stack([got[p] for p in sorted(got)]), expected, atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers_with_prefix_caching(llama, head):
    """A prompt prefix the target found in its cache gives the head no states: its
    context starts after it, and the output stays the target's."""
    shared = mixed_prompts(257, lengths=(9,))[0]
    prompts = [shared + p for p in mixed_prompts(258, lengths=(3, 11))] + [shared]
    assert_engine_matches_transformers(llama, [*BASE, "cache.enable_prefix_caching=true",
                                               "decoding.tree=[[0],[1],[0,0],[0,0,0]]"], prompts=prompts, max_tokens=10)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size"])
def test_a_head_of_another_shape_is_refused_naming_the_field(llama, tmp_path, field):
    from transformers import AutoConfig

    folder = random_eagle_head(llama, str(tmp_path / "head"), **{field: getattr(AutoConfig.from_pretrained(llama),
                                                                                  field) + 32})
    with pytest.raises(ConfigError, match=f"decoding.head_path: the head's {field}"):
        LLM(llama, overrides=[*BASE, f"decoding.head_path={folder}"])
