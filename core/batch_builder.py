"""Builds one step's flat model inputs from the scheduler's grants."""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    ``layout`` (of the first KV cache group; ``group_layouts``: of the others), and ``logits_indices`` [N]: the rows whose logits are needed, first the
    ``prompt_spans``' rows (sum of their counts; prompt logprobs), then the decoder's
    (1 + drafts per sampling request, in grant order)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    layout: BatchLayout
    logits_indices: torch.Tensor
    prompt_spans: tuple[PromptSpan, ...] = ()
    group_layouts: tuple[BatchLayout, ...] = ()

    @property
    def layouts(self) -> tuple[BatchLayout, ...]:
        """The layout of every KV cache group (they differ in block tables and slots only)."""
        return (self.layout, *self.group_layouts)

    @property
    def logits_are_all_rows(self) -> bool:
        """True when ``logits_indices`` is every row in order (a decode step whose every
        request samples one token), so the hidden states need no gather."""
        return (self.layout.max_query_len == 1 and not self.prompt_spans
                and self.logits_indices.shape[0] == self.input_ids.shape[0])


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
    one unpadded token batch: a decode step (one sampled token per request, no drafts)
    through ``decode_step_inputs``, any other through ``flat_step_inputs``. With
    ``prompt_logprobs``, the rows that give requests their missing prompt logprobs lead
    ``logits_indices``."""
    # A one-token grant that samples is at the prompt's last position or later, so it has
    # no prompt logprobs to compute (``prompt_span`` is None): the decode path needs none.
    if grants and not any(drafts) and all(grant.num_new_tokens == 1 and grant.samples for grant in grants):
        return decode_step_inputs(grants, block_size, device)
    return flat_step_inputs(grants, drafts, block_size, device, prompt_logprobs)


def flat_step_inputs(grants: Sequence[ScheduledRequest], drafts: Sequence[list[int]], block_size: int,
                     device: torch.device, prompt_logprobs: bool = False) -> StepInputs:
    """``build_step_inputs`` for any step (prefill chunks, drafts, prompt logprobs)."""
    token_ids: list[int] = []
    spans: list[PromptSpan] = []
    prompt_rows: list[int] = []
    query_lens: list[int] = []
    computed: list[int] = []
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
    seq_lens_list = [c + q for c, q in zip(computed, query_lens)]
    # Index arithmetic in numpy: a step has hundreds of requests, and numpy builds these
    # small arrays several times faster than torch ops or torch.tensor on nested lists.
    lens_array = np.array(query_lens, dtype=np.int64)
    starts_array = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(lens_array, out=starts_array[1:])
    request_index = np.repeat(np.arange(len(query_lens)), lens_array)
    position_array = np.arange(len(token_ids), dtype=np.int64) + np.repeat(
        np.array(computed, dtype=np.int64) - starts_array[:-1], lens_array)
    layouts = [_group_layout(group_tables, request_index, position_array, block_size, device)
               for group_tables in zip(*(grant.block_tables for grant in grants))]
    first = BatchLayout(
        query_start_loc=torch.from_numpy(starts_array).to(device=device, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens_list, dtype=torch.int32, device=device),
        block_table=layouts[0][0],
        slot_mapping=layouts[0][1],
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens_list),
        query_lens=tuple(query_lens),
        seq_lens_list=tuple(seq_lens_list),
    )
    return StepInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(position_array).to(device),
        layout=first,
        logits_indices=torch.tensor(prompt_rows + logits_rows, dtype=torch.int64, device=device),
        prompt_spans=tuple(spans),
        group_layouts=tuple(replace(first, block_table=table, slot_mapping=slots) for table, slots in layouts[1:]),
    )


def _group_layout(tables: Sequence[Sequence[int]], request_index: np.ndarray, position_array: np.ndarray,
                  block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV cache group's block table [R, max_blocks] (padding: 0) and the slot of each
    new token [T]."""
    block_array = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for row, table in enumerate(tables):
        block_array[row, :len(table)] = table
    slot_array = (block_array[request_index, position_array // block_size].astype(np.int64) * block_size
                  + position_array % block_size)
    return torch.from_numpy(block_array).to(device), torch.from_numpy(slot_array).to(device)


def decode_step_inputs(grants: Sequence[ScheduledRequest], block_size: int, device: torch.device,
                       ahead: int = 0, token_ids: Sequence[int] = ()) -> StepInputs:
    """``build_step_inputs`` for a step of one new token per request, every one sampled: the
    same tensors, cut from one int64 and one int32 tensor built from flat lists. At batch 1
    a step's host work is bound by the number of calls it makes (each slowed by caches the
    forward pass has just refilled), and this makes two instead of about thirty.

    ``ahead`` > 0: the inputs of the step ``ahead`` model steps after the grants' (multi-step
    decoding), each request's ``token_ids[i]`` chosen by the step before, its slot among
    the lookahead slots its blocks hold."""
    count = len(grants)
    computed = [grant.num_computed_tokens + ahead for grant in grants]
    seq_lens = [start + 1 for start in computed]
    longs = list(token_ids) if ahead else [grant.request.token_ids[start] for grant, start in zip(grants, computed)]
    longs += computed
    longs += range(count)
    ints = list(range(count + 1)) + seq_lens
    widths = []
    for tables in zip(*(grant.block_tables for grant in grants)):
        width = max(map(len, tables))
        widths.append(width)
        longs += [table[start // block_size] * block_size + start % block_size for table, start in zip(tables, computed)]
        for table in tables:
            ints += table
            ints += [0] * (width - len(table))
    input_ids, positions, logits_indices, *slots = _int_tensor(longs, torch.int64, device).split(count)
    query_start_loc, seq_lens_tensor, *tables = _int_tensor(ints, torch.int32, device).split(
        [count + 1, count, *(count * width for width in widths)])
    first = BatchLayout(query_start_loc=query_start_loc, seq_lens=seq_lens_tensor,
                        block_table=tables[0].view(count, widths[0]), slot_mapping=slots[0], block_size=block_size,
                        max_query_len=1, max_seq_len=max(seq_lens), query_lens=(1,) * count,
                        seq_lens_list=tuple(seq_lens))
    return StepInputs(input_ids=input_ids, positions=positions, layout=first, logits_indices=logits_indices,
                      group_layouts=tuple(replace(first, block_table=table.view(count, width), slot_mapping=slot)
                                          for table, width, slot in zip(tables[1:], widths[1:], slots[1:])))


def _int_tensor(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor of ``dtype`` (int32 or int64): through numpy, which converts
    a Python list several times faster per element than ``torch.tensor``, for long lists (a
    large batch's block tables); directly, one call fewer, for short ones (batch 1)."""
    if len(values) < 64:
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.from_numpy(np.array(values, dtype=np.int64 if dtype == torch.int64 else np.int32)).to(device)
