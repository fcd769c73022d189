"""Verification of draft tokens: the speculative sampling rule, batched.

For request i with drafts x_1..x_d and target distributions p_1..p_{d+1} (rows of the
target's logits after the request's temperature and filters), draft x_j is accepted with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is drawn from
normalize(max(0, p_j - q_j)); if every draft is accepted a bonus token is drawn from
p_{d+1}. The output distribution is exactly the target's. Greedy requests accept a draft
iff it equals the target's argmax, which reproduces plain greedy decoding. ``verify``
applies the rule to token trees (``core/token_tree.py``) as well as chains.
"""

from __future__ import annotations

from random import Random
from typing import Sequence

import torch

from servelab.core.decoding import DecodeBatch, DecodeResult, Proposal
from servelab.core.request import Request
from servelab.core.token_tree import chain
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
    """Accepted tokens per request (1 .. drafts + 1) and how many drafts each kept: the
    rule above walked down each request's token tree (a chain is the tree whose drafts
    each continue the one before). At a node whose target distribution is p, its children
    c (each drawn from q_c given its earlier siblings) are tried in order: c is accepted
    with probability min(1, p(c) / q_c(c)), else p becomes normalize(max(0, p - q_c)) for
    the next sibling; when every child is rejected the token is drawn from p (SpecInfer's
    multi-step speculative sampling; with one child per node, the chain rule above)."""
    requests, counts = batch.requests, batch.num_draft_tokens
    row_requests = [r for r, n in zip(requests, counts) for _ in range(n + 1)]
    raw = logits.clone() if any(r.sampling_params.logprobs is not None for r in requests) else None
    probs = target_probabilities(logits, row_requests)
    drafts = proposal.draft_token_ids if proposal is not None else [[] for _ in requests]
    trees = proposal.parents if proposal is not None and proposal.parents is not None else None
    parents = trees or [chain(len(d)) for d in drafts]
    vocab = probs.shape[-1]
    starts, draft_starts, parent_rows = [], [], []
    row = draft_row = 0
    for draft, tree in zip(drafts, parents):
        starts.append(row)
        draft_starts.append(draft_row)
        parent_rows += [row + 1 + p for p in tree]
        row += len(draft) + 1
        draft_row += len(draft)
    flat_drafts = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=probs.device)
    if proposal is not None and proposal.draft_probs is not None:
        q = proposal.draft_probs
    else:
        q = torch.nn.functional.one_hot(flat_drafts, vocab).to(probs.dtype)
    p_draft = probs[parent_rows].gather(1, flat_drafts[:, None])[:, 0].tolist() if parent_rows else []
    q_draft = q.gather(1, flat_drafts[:, None])[:, 0].tolist() if parent_rows else []
    uniforms = _uniforms(requests, counts, probs.device)
    token_ids: list[list[int]] = []
    paths: list[list[int]] = []
    ranks: list[list[int]] = []
    residuals: list[torch.Tensor] = []
    for i, (draft, tree) in enumerate(zip(drafts, parents)):
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(tree):
            children.setdefault(parent, []).append(node)
        path: list[int] = []
        rank: list[int] = []
        node, residual = -1, None
        while node in children:
            residual, chosen = None, None
            for sibling, child in enumerate(children[node]):
                flat = draft_starts[i] + child
                p = p_draft[flat] if residual is None else float(residual[draft[child]])
                if uniforms[i][child] * q_draft[flat] <= p and p > 0.0:
                    chosen = child
                    break
                current = probs[starts[i] + 1 + node] if residual is None else residual
                left = (current - q[flat]).clamp_min(0.0)
                total = left.sum()
                residual = left / total if total > 0 else current
            rank.append(sibling if chosen is not None else -1)
            if chosen is None:
                break
            path.append(chosen)
            node, residual = chosen, None
        residuals.append(probs[starts[i] + 1 + node] if residual is None else residual)
        paths.append(path)
        ranks.append(rank)
        token_ids.append([draft[n] for n in path])
    final = torch.stack(residuals)
    final = final / final.sum(dim=-1, keepdim=True)
    greedy_rows = [k for k, r in enumerate(requests) if r.sampling_params.greedy]
    chosen_tokens = random_race(final, list(requests))
    if greedy_rows:
        index = torch.tensor(greedy_rows, device=final.device)
        chosen_tokens[index] = final[index].argmax(dim=-1)
    for k, token in enumerate(chosen_tokens.tolist()):
        token_ids[k].append(token)
    rows = [[starts[i]] + [starts[i] + 1 + n for n in path] for i, path in enumerate(paths)]
    return DecodeResult(token_ids, None if raw is None else _logprobs(raw, rows, token_ids, requests),
                        tuple(counts), [len(path) for path in paths], paths if trees is not None else None, ranks)


def _logprobs(raw: torch.Tensor, token_rows: list[list[int]], token_ids: list[list[int]],
              requests: Sequence[Request]) -> list:
    """Logprobs of every emitted token under the target's raw distribution at its row
    (``token_rows[i][j]``: the row that predicted token j of request i)."""
    rows = [row for request_rows, tokens in zip(token_rows, token_ids) for row in request_rows[:len(tokens)]]
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
