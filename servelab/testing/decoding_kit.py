"""Conformance kit for decoding strategies: tokens per step, the cache after rollback, and
greedy output, on whole engines."""

from __future__ import annotations

import math

from servelab.core.sampling_params import SamplingParams
from servelab.testing.engine_kit import EngineKit, record_steps, run_to_completion

LENGTHS = (3, 17, 40, 9, 64)
RELEASED_TENSOR_BYTES = 1 << 20
"""What a strategy may still reach in tensors after the engine's shutdown (a draft model
and its KV tensors are gone; small constants may stay)."""


class DecodingConformance(EngineKit):
    """The ``DecodingStrategy`` contract on whole engines: greedy output (temperature 0)
    equal to transformers; every sampling request of a step gets 1 to k+1 tokens
    (k = ``num_lookahead_tokens``) and the result's speculative counts agree; after every
    step each running request's blocks cover its computed tokens and nothing past its
    tokens (rejected drafts rolled back); sampled runs end with no block held; after the
    engine's ``shutdown`` the strategy reaches no draft model or KV tensors, and a second
    ``shutdown`` does nothing. Proposals (chains or token trees) keep the tree rules
    (``core/token_tree.py``) within each request's lookahead, and each request keeps its
    drafts along one path from the root (with, when reported, each kept draft's rank among
    its siblings). A strategy that reads the target's hidden states
    gets, after every step, those of each scheduled request's kept tokens: positions that
    follow on from the ones it got before, up to the token before the last."""

    kind = "decoding"

    def test_shutdown_releases_the_strategy(self, component, kit_checkpoint, kit_draft):
        from servelab.testing.lifecycle import reachable_tensor_bytes

        llm = self.llm(component, kit_checkpoint, kit_draft)
        engine = llm.engine
        for prompt in self.prompts(engine.vocab_size, LENGTHS[:2]):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        engine.step()
        strategy = engine.strategy
        llm.shutdown()
        held = reachable_tensor_bytes(strategy)
        assert held <= RELEASED_TENSOR_BYTES, f"decoding={component} still reaches {held} bytes of tensors"
        strategy.shutdown()

    def test_greedy_matches_transformers(self, component, kit_checkpoint, kit_draft):
        from servelab.testing.oracle import assert_engine_matches_transformers

        assert_engine_matches_transformers(kit_checkpoint, self.overrides_for(component, kit_checkpoint, kit_draft),
                                           max_tokens=16)

    def test_tokens_per_step_and_rollback(self, component, kit_checkpoint, kit_draft):
        llm = self.llm(component, kit_checkpoint, kit_draft, "cache.block_size=4")
        engine = llm.engine
        steps = record_steps(engine)
        lookahead = engine.strategy.num_lookahead_tokens
        block_size = engine.cache.block_size

        def check_cache(_step: int) -> None:
            """The requests of the last step that still run hold the blocks they should."""
            last = steps.outputs[-1].scheduled if steps.outputs else ()
            for request in (g.request for g in last if not g.request.is_finished):
                held = len(engine.cache.block_table(request))
                assert math.ceil(request.num_computed_tokens / block_size) <= held, request
                assert held <= math.ceil(request.num_tokens / block_size), \
                    f"{request.request_id} holds {held} blocks for {request.num_tokens} tokens: drafts not rolled back"

        for i, prompt in enumerate(self.prompts(engine.vocab_size, LENGTHS * 2)):
            engine.add_request(prompt, SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=12, logprobs=i % 3,
                                                      ignore_eos=True))
        finished = run_to_completion(engine, between_steps=check_cache)
        assert len(finished) == 2 * len(LENGTHS)
        for output, result in ((e.output, e.result) for e in steps.executed):
            if result is None:
                continue
            assert len(result.token_ids) == len(output.sampling_requests)
            assert all(1 <= len(tokens) <= lookahead + 1 for tokens in result.token_ids), result.token_ids
            if result.num_draft_tokens is not None:
                assert all(0 <= kept <= drafted for kept, drafted in zip(result.num_accepted_drafts,
                                                                          result.num_draft_tokens))
                assert all(len(tokens) <= kept + 1 for tokens, kept in zip(result.token_ids,
                                                                            result.num_accepted_drafts))
        for output in finished:
            completion = output.outputs[0]
            assert len(completion.token_ids) == 12
            if completion.logprobs is not None:
                assert len(completion.logprobs) == 12
        assert engine.cache.usage.used_blocks == 0

    def test_proposals_are_trees_and_kept_tokens_follow_a_path(self, component, kit_checkpoint, kit_draft):
        from servelab.core.token_tree import chain, tree_problem

        llm = self.llm(component, kit_checkpoint, kit_draft)
        engine = llm.engine
        if not engine.strategy.num_lookahead_tokens:
            return
        steps = record_steps(engine)
        proposals = []
        propose = engine.strategy.propose

        def recorded(batch):
            proposal = propose(batch)
            proposals.append((batch, proposal))
            return proposal

        engine.strategy.propose = recorded
        for i, prompt in enumerate(self.prompts(engine.vocab_size, LENGTHS[:4])):
            engine.add_request(prompt * 2, SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=10,
                                                          ignore_eos=True))
        run_to_completion(engine)
        results = [e.result for e in steps.executed if e.result is not None]
        assert len(results) == len(proposals)
        for (batch, proposal), result in zip(proposals, results):
            if proposal is None:
                continue
            for i, (request, allowance) in enumerate(zip(batch.requests, batch.num_draft_tokens)):
                drafts = proposal.draft_token_ids[i]
                parents = proposal.parents[i] if proposal.parents is not None else chain(len(drafts))
                problem = tree_problem(parents, len(drafts), allowance)
                assert problem is None, f"decoding={component}, request {request.request_id}: {problem}"
                path = (result.accepted_nodes[i] if result.accepted_nodes is not None
                        else list(range(result.num_accepted_drafts[i])))
                assert all(parents[node] == (path[d - 1] if d else -1) for d, node in enumerate(path)), \
                    f"request {request.request_id} kept nodes {path}, not a path of the tree {parents}"
                assert result.token_ids[i][:len(path)] == [drafts[n] for n in path]
                assert result.num_accepted_drafts[i] == len(path)
                if result.accepted_ranks is not None:
                    ranks = [[n for n, p in enumerate(parents) if p == (path[d - 1] if d else -1)].index(node)
                             for d, node in enumerate(path)]
                    assert result.accepted_ranks[i] in (ranks, ranks + [-1]), \
                        f"request {request.request_id}: ranks {result.accepted_ranks[i]} for the kept path {path}"
        assert engine.cache.usage.used_blocks == 0

    def test_hidden_states_follow_the_kept_tokens(self, component, kit_checkpoint, kit_draft):
        from servelab.core.engine.registry import get_registry

        if not get_registry().get("decoding", component).cls.reads_hidden_states:
            return
        engine = self.llm(component, kit_checkpoint, kit_draft).engine
        handed: dict[str, int] = {}
        observe = engine.strategy.observe_hidden_states

        def recorded(hidden):
            assert hidden.states.shape[0] == sum(hidden.counts), "one state per kept token"
            for request, first, count in zip(hidden.requests, hidden.first_positions, hidden.counts):
                assert first == handed.get(request.request_id, 0), \
                    f"{request.request_id}: states from position {first}, expected {handed.get(request.request_id, 0)}"
                handed[request.request_id] = first + count
            observe(hidden)

        engine.strategy.observe_hidden_states = recorded
        for i, prompt in enumerate(self.prompts(engine.vocab_size, LENGTHS[:2])):
            engine.add_request(prompt * 2, SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=8,
                                                          ignore_eos=True))
        for output in run_to_completion(engine):
            assert handed[output.request_id] >= len(output.prompt_token_ids) + len(output.outputs[0].token_ids) - 1
        assert engine.cache.usage.used_blocks == 0
