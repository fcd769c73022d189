"""``decoding=greedy``: the argmax of the model's logits for every request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelab.core.component import ComponentSpec
from servelab.core.decoding import DecodeBatch, DecodeResult, Proposal
from servelab.plugins.decoding.logits_processing import suppress_stop_tokens
from servelab.plugins.decoding.sampler import (GrammarDecoding, OneTokenDecodingConfig, greedy_tokens,
                                               mask_with_grammars, token_logprobs)


@dataclass
class GreedyDecodingConfig(OneTokenDecodingConfig):
    """``decoding=greedy``: ``multi_step`` (``OneTokenDecodingConfig``)."""


class GreedyDecoding(GrammarDecoding):
    """The reference strategy: argmax of the raw logits. Temperature, top-k/p, min-p,
    penalties and logit bias are ignored; stop conditions, ``min_tokens``, ``max_tokens``,
    logprobs and structured output still apply."""

    def accept(self, logits: torch.Tensor, batch: DecodeBatch, proposal: Proposal | None) -> DecodeResult:
        """Take the argmax of each row."""
        raw = logits.clone() if any(r.sampling_params.logprobs is not None for r in batch.requests) else logits
        suppress_stop_tokens(logits, batch.requests)
        mask_with_grammars(logits, batch.requests, self.grammars)
        tokens = greedy_tokens(logits).tolist()
        logprobs = token_logprobs(raw, tokens, batch.requests)
        return DecodeResult([[t] for t in tokens], None if logprobs is None else [[lp] for lp in logprobs])


SPEC = ComponentSpec("decoding", "greedy", GreedyDecoding, GreedyDecodingConfig,
                     "argmax of the raw logits (reference)")
