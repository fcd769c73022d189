"""The decoding strategy contract: turn logits into accepted tokens."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from servelab.core.outputs import Logprob
from servelab.core.request import Request


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """The requests that produce tokens this step, in logits-row order.

    ``requests[i]`` owns ``1 + num_draft_tokens[i]`` consecutive logits rows (one per
    verified draft position plus the bonus position); ``scheduled`` is the whole step
    (a draft model follows it to keep its own cache in step with the target's).
    """

    requests: tuple[Request, ...]
    num_draft_tokens: tuple[int, ...]
    scheduled: Any


@dataclass(frozen=True, slots=True)
class Proposal:
    """Draft tokens per request of a ``DecodeBatch`` (possibly empty lists).

    ``draft_probs``: [sum(len(d)), V] float32 probabilities the drafter sampled from
    (None for deterministic drafters such as n-gram lookup or greedy drafts).
    """

    draft_token_ids: tuple[list[int], ...]
    draft_probs: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """Accepted tokens per request of the batch (1 .. k+1 each).

    ``logprobs[i][j]``: for token j of request i, token id -> Logprob (None when no request
    asked for logprobs). ``num_accepted_drafts[i]`` counts verified draft tokens kept.
    """

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob]]] | None = None
    num_accepted_drafts: list[int] | None = None


class DecodingStrategy(abc.ABC):
    """Chooses the next tokens from the model's logits.

    Plain strategies set ``num_lookahead_tokens = 0`` and return no proposal; speculative
    strategies propose up to ``num_lookahead_tokens`` drafts per request that the target
    verifies in one forward pass.
    """

    num_lookahead_tokens: int = 0

    def __init__(self, config: Any, context: Any = None):
        self.config = config
        self.context = context

    def propose(self, batch: DecodeBatch) -> Proposal | None:
        """Draft tokens for the batch, or None."""
        return None

    @abc.abstractmethod
    def accept(self, logits: torch.Tensor, batch: DecodeBatch, proposal: Proposal | None) -> DecodeResult:
        """logits: [sum(1 + drafts), V] float32. Returns the tokens each request keeps."""

    def on_request_finished(self, request: Request) -> None:
        """Release whatever per-request state the strategy keeps (draft caches, ...)."""
