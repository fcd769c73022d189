"""Batched logits processing: logit bias, min_tokens, penalties, temperature, top-k, top-p, min-p."""

from __future__ import annotations

from typing import Sequence

import torch

from servelab.core.request import Request


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Add each request's ``logit_bias`` to its row, all rows in one scatter (in place)."""
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for row, request in enumerate(requests):
        bias = request.sampling_params.logit_bias
        if bias:
            rows += [row] * len(bias)
            tokens += bias.keys()
            values += bias.values()
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def suppress_stop_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Forbid EOS and stop token ids for rows that have not reached ``min_tokens`` (in place)."""
    for row, request in enumerate(requests):
        params = request.sampling_params
        if params.min_tokens and request.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids)
            if request.eos_token_id is not None and not params.ignore_eos:
                banned.append(request.eos_token_id)
            banned = [t for t in banned if t < logits.shape[-1]]
            if banned:
                logits[row, banned] = float("-inf")


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Presence, frequency (over generated tokens) and repetition (over prompt and
    generated tokens) penalties, for the rows that set any (in place)."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
    if not rows:
        return
    vocab = logits.shape[-1]
    device = logits.device
    counts = torch.zeros(len(rows), vocab, device=device)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for k, row in enumerate(rows):
        request = requests[row]
        output = torch.tensor(request.output_token_ids, dtype=torch.long, device=device)
        counts[k].index_add_(0, output, torch.ones(len(output), device=device))
        seen[k, torch.tensor(request.prompt_token_ids, dtype=torch.long, device=device)] = True
    seen |= counts > 0
    params = [requests[row].sampling_params for row in rows]
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    index = torch.tensor(rows, device=device)
    selected = logits[index]
    penalised = torch.where(selected > 0, selected / repetition, selected * repetition)
    selected = torch.where(seen, penalised, selected)
    selected -= frequency * counts + presence * (counts > 0).float()
    logits[index] = selected


def apply_temperature_and_filters(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Divide by temperature, then mask tokens outside top-k, top-p and min-p (returns logits)."""
    device = logits.device
    params = [r.sampling_params for r in requests]
    temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        remove = rank >= torch.tensor(top_k, device=device)[:, None]
        probs = sorted_logits.softmax(dim=-1)
        remove |= (probs.cumsum(dim=-1) - probs) > torch.tensor(top_p, device=device)[:, None]
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
