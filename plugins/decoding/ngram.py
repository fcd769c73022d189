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
    to ``prompt_lookup_min``. ``simulated_acceptance_rate``: under
    ``executor=simulated``, the probability that the target accepts each draft token."""

    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    simulated_acceptance_rate: float = 0.5


def lookup(tokens: list[int], max_n: int, min_n: int, k: int) -> list[int]:
    """What followed the most recent earlier match of the last n tokens (longest n first)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


class NgramDecoding(DecodingStrategy):
    """Drafts by matching the sequence against itself; verified by the target in one pass."""

    def __init__(self, config: NgramDecodingConfig, context=None):
        super().__init__(config, context)
        problems = speculation_problems(config)
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            problems.append("decoding.prompt_lookup_min must be >= 1 and <= decoding.prompt_lookup_max, got "
                            f"{config.prompt_lookup_min} and {config.prompt_lookup_max}")
        if problems:
            raise ConfigError(problems)
        self.num_lookahead_tokens = config.num_speculative_tokens

    def propose(self, batch: DecodeBatch) -> Proposal:
        """An n-gram draft for each request allowed lookahead tokens."""
        config = self.config
        drafts = tuple(lookup(r.token_ids, config.prompt_lookup_max, config.prompt_lookup_min, allowance)
                       if allowance else [] for r, allowance in zip(batch.requests, batch.num_draft_tokens))
        return Proposal(drafts)

    def accept(self, logits: torch.Tensor, batch: DecodeBatch, proposal: Proposal | None) -> DecodeResult:
        """The speculative sampling rule with a deterministic (one-hot) drafter."""
        return verify(logits, batch, proposal)

    def simulated_acceptance(self, allowances: tuple[int, ...], random: Random) -> list[int]:
        """Each draft kept with probability ``simulated_acceptance_rate`` (an n-gram draft
        costs no forward pass)."""
        return simulated_acceptance(allowances, self.config.simulated_acceptance_rate, random)


SPEC = ComponentSpec("decoding", "ngram", NgramDecoding, NgramDecodingConfig,
                     "prompt-lookup speculative decoding: drafts from earlier n-gram matches")
