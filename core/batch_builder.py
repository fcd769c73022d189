"""Builds one step's flat model inputs from the scheduler's grants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from servelab.core.attention import BatchLayout
from servelab.core.scheduler import ScheduledRequest


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Model inputs for one step: ``input_ids`` and ``positions`` [T], the attention
    ``layout``, and ``logits_indices`` [N]: the rows whose logits the decoder needs
    (1 + drafts per sampling request, in grant order)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    layout: BatchLayout
    logits_indices: torch.Tensor


def build_step_inputs(grants: Sequence[ScheduledRequest], drafts: Sequence[list[int]], block_size: int,
                      device: torch.device) -> StepInputs:
    """Flatten the grants (with ``drafts[i]`` appended to the i-th sampling request) into
    one unpadded token batch; positions and slots are computed with tensor ops."""
    token_ids: list[int] = []
    query_lens: list[int] = []
    computed: list[int] = []
    tables: list[list[int]] = []
    logits_rows: list[int] = []
    draft_iter = iter(drafts)
    for grant in grants:
        start = grant.num_computed_tokens
        count = grant.num_new_tokens
        token_ids += grant.request.token_ids[start:start + count]
        if grant.samples:
            draft = next(draft_iter, ())
            token_ids += draft
            end = len(token_ids)
            logits_rows.extend(range(end - 1 - len(draft), end))
            count += len(draft)
        query_lens.append(count)
        computed.append(start)
        tables.append(grant.block_ids)
    seq_lens_list = [c + q for c, q in zip(computed, query_lens)]
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]

    lens = torch.tensor(query_lens, dtype=torch.int64)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=starts[1:])
    offsets = torch.repeat_interleave(starts[:-1] - torch.tensor(computed, dtype=torch.int64), lens)
    positions = torch.arange(len(token_ids), dtype=torch.int64) - offsets
    block_table = torch.tensor(padded, dtype=torch.int32)
    request_index = torch.repeat_interleave(torch.arange(len(query_lens)), lens)
    slots = block_table[request_index, positions // block_size].long() * block_size + positions % block_size
    layout = BatchLayout(
        query_start_loc=starts.to(device=device, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens_list, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=slots.to(device),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens_list),
        query_lens=tuple(query_lens),
        seq_lens_list=tuple(seq_lens_list),
    )
    return StepInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=positions.to(device),
        layout=layout,
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
    )
