"""Which of a step's hidden states a strategy that reads them gets: those of the tokens
the step kept (``HiddenStates``)."""

from __future__ import annotations

from typing import Sequence

import torch

from servelab.core.decode_result import DecodeResult
from servelab.core.decoding import HiddenStates
from servelab.core.scheduler import SchedulerOutput


def kept_hidden_states(output: SchedulerOutput, hidden: torch.Tensor, drafts: Sequence[list[int]],
                       result: DecodeResult | None) -> HiddenStates:
    """The rows of ``hidden`` ([step tokens, hidden], the flat batch's order: each grant's
    new tokens, then a sampling grant's ``drafts``) that belong to kept tokens: every new
    token, and the drafts ``result`` kept (a tree's ``accepted_nodes``, else the first
    ``num_accepted_drafts``)."""
    rows: list[int] = []
    requests, firsts, counts = [], [], []
    start, sampling = 0, 0
    for grant in output.scheduled:
        new = grant.num_new_tokens
        rows.extend(range(start, start + new))
        start += new
        kept = 0
        if grant.samples:
            count = len(drafts[sampling]) if sampling < len(drafts) else 0
            if count and result is not None:
                nodes = (result.accepted_nodes[sampling] if result.accepted_nodes is not None
                         else range(result.num_accepted_drafts[sampling]))
                rows.extend(start + node for node in nodes)
                kept = len(nodes)
            start += count
            sampling += 1
        requests.append(grant.request)
        firsts.append(grant.num_computed_tokens)
        counts.append(new + kept)
    index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
    return HiddenStates(tuple(requests), tuple(firsts), tuple(counts), hidden.index_select(0, index))
