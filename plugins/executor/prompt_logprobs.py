"""Prompt logprobs from the prefill pass: the logits rows a step computed for them."""

from __future__ import annotations

import torch

from servelab.core.batch_builder import PromptSpan
from servelab.core.executor import PromptLogprobs
from servelab.plugins.decoding.sampler import ranked_logprobs


def prompt_logprobs(logits: torch.Tensor, spans: tuple[PromptSpan, ...]) -> tuple[PromptLogprobs, ...]:
    """logits: [sum of the spans' counts, V], the spans' rows in order. Each prompt token's
    log probability and rank with its request's top ``prompt_logprobs`` alternatives."""
    if not spans:
        return ()
    tokens, top_ns = [], []
    for span in spans:
        tokens += span.request.token_ids[span.first:span.first + span.count]
        top_ns += [span.request.sampling_params.prompt_logprobs] * span.count
    entries = ranked_logprobs(logits, tokens, top_ns)
    chunks, offset = [], 0
    for span in spans:
        chunks.append(PromptLogprobs(span.request, span.first, entries[offset:offset + span.count]))
        offset += span.count
    return tuple(chunks)
