"""Builds one step's flat model inputs from the scheduler's grants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from servelab.core.attention import BatchLayout
from servelab.core.request import Request
from servelab.core.scheduler import ScheduledRequest


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """Prompt tokens ``first .. first + count - 1`` of ``request`` whose logprobs this step
    computes (from the rows of the tokens before them)."""

    request: Request
    first: int
    count: int


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Model inputs for one step: ``input_ids`` and ``positions`` [T], the attention
    ``layout``, and ``logits_indices`` [N]: the rows whose logits are needed, first the
    ``prompt_spans``' rows (sum of their counts; prompt logprobs), then the decoder's
    (1 + drafts per sampling request, in grant order)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    layout: BatchLayout
    logits_indices: torch.Tensor
    prompt_spans: tuple[PromptSpan, ...] = ()


def prompt_span(grant: ScheduledRequest) -> PromptSpan | None:
    """The prompt tokens whose logprobs ``grant`` can compute and its request still lacks:
    a row at position p gives token p + 1's logprob."""
    request = grant.request
    if not request.needs_prompt_logprobs:
        return None
    have = len(request.prompt_logprobs)
    start = grant.num_computed_tokens
    last = min(start + grant.num_new_tokens, request.num_prompt_tokens - 1)
    if not start < have <= last:
        return None
    return PromptSpan(request, have, last + 1 - have)


def build_step_inputs(grants: Sequence[ScheduledRequest], drafts: Sequence[list[int]], block_size: int,
                      device: torch.device, prompt_logprobs: bool = False) -> StepInputs:
    """Flatten the grants (with ``drafts[i]`` appended to the i-th sampling request) into
    one unpadded token batch; positions and slots are computed with array ops. With
    ``prompt_logprobs``, the rows that give requests their missing prompt logprobs lead
    ``logits_indices``."""
    token_ids: list[int] = []
    spans: list[PromptSpan] = []
    prompt_rows: list[int] = []
    query_lens: list[int] = []
    computed: list[int] = []
    tables: list[list[int]] = []
    logits_rows: list[int] = []
    draft_iter = iter(drafts)
    for grant in grants:
        start = grant.num_computed_tokens
        count = grant.num_new_tokens
        span = prompt_span(grant) if prompt_logprobs else None
        if span is not None:
            first_row = len(token_ids) + span.first - 1 - start
            prompt_rows.extend(range(first_row, first_row + span.count))
            spans.append(span)
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
        logits_indices=torch.tensor(prompt_rows + logits_rows, dtype=torch.int64, device=device),
        prompt_spans=tuple(spans),
    )
