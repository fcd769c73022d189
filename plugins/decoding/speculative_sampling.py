"""Verification of draft tokens: the speculative sampling rule, batched.

For request i with drafts x_1..x_d and target distributions p_1..p_{d+1} (rows of the
target's logits after the request's temperature and filters), draft x_j is accepted with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is drawn from
normalize(max(0, p_j - q_j)); if every draft is accepted a bonus token is drawn from
p_{d+1}. The output distribution is exactly the target's. Greedy requests accept a draft
iff it equals the target's argmax, which reproduces plain greedy decoding.
"""

from __future__ import annotations

from random import Random
from typing import Sequence

import torch

from servelab.core.decoding import DecodeBatch, DecodeResult, Proposal
from servelab.core.request import Request
from servelab.plugins.decoding.logits_processing import apply_temperature_and_filters
from servelab.plugins.decoding.sampler import processed_logits, random_race, request_generator, token_logprobs


def target_probabilities(logits: torch.Tensor, row_requests: Sequence[Request]) -> torch.Tensor:
    """The distribution each row samples from: [N, V] (one-hot argmax for greedy rows)."""
    logits = processed_logits(logits, row_requests)
    probs = apply_temperature_and_filters(logits, row_requests).softmax(dim=-1)
    greedy = [i for i, r in enumerate(row_requests) if r.sampling_params.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        probs[rows] = torch.nn.functional.one_hot(logits[rows].argmax(dim=-1), logits.shape[-1]).to(probs.dtype)
    return probs


def _uniforms(requests: Sequence[Request], counts: Sequence[int], device: torch.device) -> list[list[float]]:
    return [torch.rand(n, generator=request_generator(r, device), device=device).tolist() if n else []
            for r, n in zip(requests, counts)]


def verify(logits: torch.Tensor, batch: DecodeBatch, proposal: Proposal | None) -> DecodeResult:
    """Accepted tokens per request (1 .. drafts + 1) and how many drafts each kept."""
    requests, counts = batch.requests, batch.num_draft_tokens
    row_requests = [r for r, n in zip(requests, counts) for _ in range(n + 1)]
    raw = logits.clone() if any(r.sampling_params.logprobs is not None for r in requests) else None
    probs = target_probabilities(logits, row_requests)
    drafts = proposal.draft_token_ids if proposal is not None else [[] for _ in requests]
    vocab = probs.shape[-1]
    starts, draft_rows, draft_starts = [], [], []
    row = draft_row = 0
    for draft in drafts:
        starts.append(row)
        draft_starts.append(draft_row)
        draft_rows += range(row, row + len(draft))
        row += len(draft) + 1
        draft_row += len(draft)
    flat_drafts = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=probs.device)
    if proposal is not None and proposal.draft_probs is not None:
        q = proposal.draft_probs
    else:
        q = torch.nn.functional.one_hot(flat_drafts, vocab).to(probs.dtype)
    p_draft = probs[draft_rows].gather(1, flat_drafts[:, None])[:, 0].tolist() if draft_rows else []
    q_draft = q.gather(1, flat_drafts[:, None])[:, 0].tolist() if draft_rows else []
    uniforms = _uniforms(requests, counts, probs.device)
    token_ids: list[list[int]] = []
    accepted_counts: list[int] = []
    resample_rows: list[int] = []
    resample_residual: list[torch.Tensor] = []
    resample_owner: list[int] = []
    for i, (request, draft) in enumerate(zip(requests, drafts)):
        accepted = 0
        for j, token in enumerate(draft):
            p, qv = p_draft[draft_starts[i] + j], q_draft[draft_starts[i] + j]
            if uniforms[i][j] * qv <= p and p > 0.0:
                accepted += 1
            else:
                break
        row = starts[i] + accepted
        if accepted < len(draft):
            residual = (probs[row] - q[draft_starts[i] + accepted]).clamp_min(0.0)
            resample_residual.append(residual if residual.sum() > 0 else probs[row])
        else:
            resample_residual.append(probs[row])
        resample_rows.append(row)
        resample_owner.append(i)
        token_ids.append(list(draft[:accepted]))
        accepted_counts.append(accepted)
    final = torch.stack(resample_residual)
    final = final / final.sum(dim=-1, keepdim=True)
    owners = [requests[i] for i in resample_owner]
    greedy_rows = [k for k, r in enumerate(owners) if r.sampling_params.greedy]
    chosen = random_race(final, owners)
    if greedy_rows:
        index = torch.tensor(greedy_rows, device=final.device)
        chosen[index] = final[index].argmax(dim=-1)
    for k, token in enumerate(chosen.tolist()):
        token_ids[resample_owner[k]].append(token)
    return DecodeResult(token_ids, None if raw is None else _logprobs(raw, starts, token_ids, requests),
                        tuple(counts), accepted_counts)


def _logprobs(raw: torch.Tensor, starts: list[int], token_ids: list[list[int]], requests: Sequence[Request]) -> list:
    """Logprobs of every emitted token under the target's raw distribution at its row."""
    rows = [starts[i] + j for i, tokens in enumerate(token_ids) for j in range(len(tokens))]
    owners = [requests[i] for i, tokens in enumerate(token_ids) for _ in tokens]
    flat = token_logprobs(raw[rows], [t for tokens in token_ids for t in tokens], owners)
    grouped, k = [], 0
    for tokens in token_ids:
        grouped.append(flat[k:k + len(tokens)])
        k += len(tokens)
    return grouped


def simulated_acceptance(allowances: Sequence[int], rate: float, random: Random) -> list[int]:
    """Drafts kept per request when each is accepted with probability ``rate`` on its own
    and the first rejection ends the run (``executor=simulated``)."""
    kept = []
    for allowance in allowances:
        count = 0
        while count < allowance and random.random() < rate:
            count += 1
        kept.append(count)
    return kept


def speculation_problems(config) -> list[str]:
    """What is wrong with a speculative config's ``num_speculative_tokens`` and
    ``simulated_acceptance_rate``."""
    problems = []
    if config.num_speculative_tokens < 0:
        problems.append(f"decoding.num_speculative_tokens must be >= 0, got {config.num_speculative_tokens}")
    if not 0.0 <= config.simulated_acceptance_rate <= 1.0:
        problems.append(f"decoding.simulated_acceptance_rate must be in [0, 1], got {config.simulated_acceptance_rate}")
    return problems
