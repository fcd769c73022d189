"""A step's flat inputs: the decode path gives the tensors the general builder gives."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from servelab import SamplingParams
from servelab.core.batch_builder import build_step_inputs, decode_step_inputs, flat_step_inputs
from servelab.core.request import Request
from servelab.core.scheduler import ScheduledRequest

BLOCK_SIZE = 4


def decode_grant(index: int, length: int, groups: int = 1) -> ScheduledRequest:
    """A request of ``length`` tokens whose last one is this step's single new token, with
    one block table per KV cache group (distinct block ids)."""
    request = Request(f"r{index}", [7 * index + j for j in range(length)], SamplingParams(max_tokens=4), None)
    blocks = (length + BLOCK_SIZE - 1) // BLOCK_SIZE
    tables = [tuple(100 * group + 10 * index + b for b in range(blocks)) for group in range(groups)]
    return ScheduledRequest(request, length - 1, 1, tables[0], True, tuple(tables[1:]))


def assert_same_inputs(got, want) -> None:
    for field in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert getattr(got, field).dtype == getattr(want, field).dtype, field
    assert got.prompt_spans == want.prompt_spans
    assert len(got.layouts) == len(want.layouts)
    for mine, theirs in zip(got.layouts, want.layouts):
        for field in dataclasses.fields(mine):
            a, b = getattr(mine, field.name), getattr(theirs, field.name)
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b) and a.dtype == b.dtype and a.is_contiguous(), field.name
            else:
                assert a == b, field.name


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("lengths", [[1], [17], [3, 9, 4, 12], [8, 5], [5 + 3 * i for i in range(24)]])
def test_decode_step_equals_the_general_builder(lengths, groups):
    grants = [decode_grant(i, n, groups) for i, n in enumerate(lengths)]
    got = build_step_inputs(grants, (), BLOCK_SIZE, torch.device("cpu"), prompt_logprobs=True)
    assert_same_inputs(got, flat_step_inputs(grants, (), BLOCK_SIZE, torch.device("cpu"), prompt_logprobs=True))
    assert_same_inputs(decode_step_inputs(grants, BLOCK_SIZE, torch.device("cpu")), got)
    assert got.logits_are_all_rows


def test_steps_that_are_not_plain_decode_take_the_general_builder():
    grants = [decode_grant(0, 6), decode_grant(1, 9)]
    drafted = build_step_inputs(grants, [[3, 4], []], BLOCK_SIZE, torch.device("cpu"))
    assert drafted.input_ids.tolist() == [5, 3, 4, 7 + 8]
    assert not drafted.logits_are_all_rows
    chunk = dataclasses.replace(grants[1], samples=False)  # a prompt chunk that yields no token
    partial = build_step_inputs([grants[0], chunk], (), BLOCK_SIZE, torch.device("cpu"))
    assert partial.logits_indices.tolist() == [0]
    assert not partial.logits_are_all_rows
