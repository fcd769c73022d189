"""``decoding=ngram``: prompt-lookup speculative decoding (no draft model)."""

from __future__ import annotations

from dataclasses import dataclass
from random import Random

import torch

from servelab.core.component import ComponentSpec
from servelab.core.decoding import DecodeBatch, DecodeResult, DecodingStrategy, Proposal
from servelab.core.errors import ConfigError
from servelab.plugins.decoding.speculative_sampling import simulated_acceptance, speculation_problems, verify


@dataclass
class NgramDecodingConfig:
    """Propose up to ``num_speculative_tokens`` tokens that followed the latest earlier
    occurrence of the sequence's last n tokens, trying n from ``prompt_lookup_max`` down
    to ``prompt_lookup_min``. ``branches`` > 1: a token tree of the continuations of up to
    that many earlier matches (distinct ones, longest n then most recent first), merged
    where they agree; it takes up to ``branches * num_speculative_tokens`` lookahead
    tokens. ``simulated_acceptance_rate``: under ``executor=simulated``, the probability
    that the target accepts each draft token."""

    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    simulated_acceptance_rate: float = 0.5
    branches: int = 1


def lookup(tokens: list[int], max_n: int, min_n: int, k: int) -> list[int]:
    """What followed the most recent earlier match of the last n tokens (longest n first)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def lookup_branches(tokens: list[int], max_n: int, min_n: int, k: int, branches: int) -> list[list[int]]:
    """Up to ``branches`` distinct continuations of up to ``k`` tokens that followed earlier
    matches of the last n tokens (longest n first, then the most recent match)."""
    length = len(tokens)
    found: list[list[int]] = []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                continuation = tokens[start + n:start + n + k]
                if continuation not in found:
                    found.append(continuation)
                    if len(found) == branches:
                        return found
    return found


def merged_tree(branches: list[list[int]], limit: int) -> tuple[list[int], list[int]]:
    """The branches as one token tree (tokens, parents), sharing their common prefixes,
    cut to its first ``limit`` nodes (parents come first)."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}
    for branch in branches:
        node = -1
        for token in branch:
            if (node, token) not in children:
                if len(tokens) == limit:
                    break
                children[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = children[(node, token)]
    return tokens, parents


class NgramDecoding(DecodingStrategy):
    """Drafts by matching the sequence against itself; verified by the target in one pass."""

    def __init__(self, config: NgramDecodingConfig, context=None):
        super().__init__(config, context)
        problems = speculation_problems(config)
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            problems.append("decoding.prompt_lookup_min must be >= 1 and <= decoding.prompt_lookup_max, got "
                            f"{config.prompt_lookup_min} and {config.prompt_lookup_max}")
        if config.branches < 1:
            problems.append(f"decoding.branches must be >= 1 (1: a chain), got {config.branches}")
        if problems:
            raise ConfigError(problems)
        self.num_lookahead_tokens = config.num_speculative_tokens * max(config.branches, 1)
        self.proposes_trees = config.branches > 1

    def propose(self, batch: DecodeBatch) -> Proposal:
        """An n-gram draft (a chain, or a tree of ``branches`` matches) for each request
        allowed lookahead tokens."""
        config = self.config
        if config.branches == 1:
            drafts = tuple(lookup(r.token_ids, config.prompt_lookup_max, config.prompt_lookup_min, allowance)
                           if allowance else [] for r, allowance in zip(batch.requests, batch.num_draft_tokens))
            return Proposal(drafts)
        trees = [merged_tree(lookup_branches(r.token_ids, config.prompt_lookup_max, config.prompt_lookup_min,
                                             min(allowance, config.num_speculative_tokens), config.branches), allowance)
                 if allowance else ([], []) for r, allowance in zip(batch.requests, batch.num_draft_tokens)]
        return Proposal(tuple(t for t, _ in trees), parents=tuple(p for _, p in trees))

    def accept(self, logits: torch.Tensor, batch: DecodeBatch, proposal: Proposal | None) -> DecodeResult:
        """The speculative sampling rule with a deterministic (one-hot) drafter."""
        return verify(logits, batch, proposal)

    def simulated_acceptance(self, allowances: tuple[int, ...], random: Random) -> list[int]:
        """Each draft kept with probability ``simulated_acceptance_rate`` (an n-gram draft
        costs no forward pass)."""
        return simulated_acceptance(allowances, self.config.simulated_acceptance_rate, random)


SPEC = ComponentSpec("decoding", "ngram", NgramDecoding, NgramDecodingConfig,
                     "prompt-lookup speculative decoding: drafts from earlier n-gram matches")
