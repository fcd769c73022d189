"""``decoding=sampling``: each request's temperature, top-k/p, min-p, penalties and seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelab.core.component import ComponentSpec
from servelab.core.decoding import DecodeBatch, DecodeResult, Proposal
from servelab.plugins.decoding.sampler import (GrammarDecoding, OneTokenDecodingConfig, greedy_tokens,
                                               sample_tokens, token_logprobs)


@dataclass
class SamplingDecodingConfig(OneTokenDecodingConfig):
    """``decoding=sampling``: ``multi_step`` (``OneTokenDecodingConfig``); every sampling knob
    is a per-request ``SamplingParams``."""


class SamplingDecoding(GrammarDecoding):
    """One token per request from its processed distribution (temperature 0 = argmax),
    within its grammar when it asks for structured output."""

    def accept(self, logits: torch.Tensor, batch: DecodeBatch, proposal: Proposal | None) -> DecodeResult:
        """Sample one token per request."""
        if all(request.sampling_params.plain_argmax for request in batch.requests):  # greedy, nothing else asked
            return DecodeResult([[t] for t in greedy_tokens(logits).tolist()], None)
        raw = logits.clone() if any(r.sampling_params.logprobs is not None for r in batch.requests) else logits
        tokens = sample_tokens(logits, batch.requests, self.grammars).tolist()
        logprobs = token_logprobs(raw, tokens, batch.requests)
        return DecodeResult([[t] for t in tokens], None if logprobs is None else [[lp] for lp in logprobs])


SPEC = ComponentSpec("decoding", "sampling", SamplingDecoding, SamplingDecodingConfig,
                     "per-request temperature, top-k, top-p, min-p, penalties and seeds")
