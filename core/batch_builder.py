"""Builds one step's flat model inputs from the scheduler's grants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
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
    one unpadded token batch; positions and slots are computed with array ops."""
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
    # Index arithmetic in numpy: a step has hundreds of requests, and numpy builds these
    # small arrays several times faster than torch ops or torch.tensor on nested lists.
    max_blocks = max(len(t) for t in tables)
    block_array = np.zeros((len(tables), max_blocks), dtype=np.int32)
    for row, table in enumerate(tables):
        block_array[row, :len(table)] = table
    lens_array = np.array(query_lens, dtype=np.int64)
    starts_array = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(lens_array, out=starts_array[1:])
    request_index = np.repeat(np.arange(len(query_lens)), lens_array)
    position_array = np.arange(len(token_ids), dtype=np.int64) + np.repeat(
        np.array(computed, dtype=np.int64) - starts_array[:-1], lens_array)
    slot_array = (block_array[request_index, position_array // block_size].astype(np.int64) * block_size
                  + position_array % block_size)
    starts = torch.from_numpy(starts_array)
    positions = torch.from_numpy(position_array)
    block_table = torch.from_numpy(block_array)
    slots = torch.from_numpy(slot_array)
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
