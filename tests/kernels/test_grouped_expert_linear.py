"""The grouped expert matmuls (``grouped_expert_linear`` in csrc/blocked_linear.cpp,
``grouped_w8a8_linear`` in csrc/w8a8_linear.cpp): several experts' rows, each times its own
matrix of a stack, in one call, equal to the bit to one ``float_linear`` / ``bf16_linear`` /
``int8_linear`` / ``w8a8_linear`` call per expert, for groups of 1 to 40 rows (the VNNI tiles of up to 6 rows,
the tile unit's 16 from 4 rows), experts without rows skipped and in any order."""

from __future__ import annotations

import itertools

import pytest
import torch

from servelab.kernels.blocked_linear import float_linear, pack_blocks
from servelab.kernels.cpu_ops import native_cpu_available
from servelab.kernels.quantized_cpu import pack_int8
from servelab.kernels.quantized_weights import quantize_int8
from servelab.kernels.w8a8_cpu import pack_w8a8, w8a8_linear, w8a8_unavailable_reason

pytestmark = pytest.mark.skipif(not native_cpu_available(), reason="native CPU ops are not built here")

EXPERTS, OUT_FEATURES, IN_FEATURES = 5, 72, 40  # two tiles, the second partial; K not a multiple of 16
GROUPS = [([3], [1]), ([0, 2, 4], [2, 7, 1]), ([1, 3], [16, 40]), ([4, 0, 1], [5, 3, 17])]
"""(experts, rows per expert): one row; decode-like few rows; tile-unit sizes; unsorted experts."""


def grouped_args(experts: list[int], sizes: list[int]) -> tuple[list[int], list[int], list[int]]:
    return experts, list(itertools.accumulate(sizes[:-1], initial=0)), sizes


def matrices(seed: int = 0) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return [torch.randn(OUT_FEATURES, IN_FEATURES) for _ in range(EXPERTS)]


@pytest.mark.parametrize("experts, sizes", GROUPS)
def test_float32_and_int8_experts_equal_one_call_each(experts, sizes):
    weights = matrices()
    x = torch.randn(sum(sizes), IN_FEATURES)
    floats = torch.stack([pack_blocks(w) for w in weights])
    int8 = [pack_int8(*quantize_int8(w)) for w in weights]
    int8_packed, int8_scales = torch.stack([p for p, _ in int8]), torch.stack([s for _, s in int8])
    args = grouped_args(experts, sizes)
    grouped_float = torch.empty(x.shape[0], OUT_FEATURES)
    torch.ops.servelab_cpu.grouped_expert_linear(grouped_float, x, floats, torch.empty(0), *args)
    grouped_int8 = torch.empty(x.shape[0], OUT_FEATURES)
    torch.ops.servelab_cpu.grouped_expert_linear(grouped_int8, x, int8_packed, int8_scales, *args)
    for expert, start, size in zip(*args):
        rows = x[start:start + size]
        assert torch.equal(grouped_float[start:start + size], float_linear(rows, floats[expert], OUT_FEATURES))
        one = torch.empty(size, OUT_FEATURES)
        torch.ops.servelab_cpu.int8_linear(one, rows, *int8[expert])
        assert torch.equal(grouped_int8[start:start + size], one)


@pytest.mark.parametrize("experts, sizes", GROUPS)
def test_bfloat16_experts_equal_one_call_each(experts, sizes):
    """bfloat16 rows and experts: each group's rows as ``bf16_linear`` gives them (float32
    sums rounded once)."""
    stacked = torch.stack([pack_blocks(w.bfloat16()) for w in matrices(2)])
    x = torch.randn(sum(sizes), IN_FEATURES).bfloat16()
    args = grouped_args(experts, sizes)
    grouped = torch.empty(x.shape[0], OUT_FEATURES, dtype=torch.bfloat16)
    torch.ops.servelab_cpu.grouped_expert_linear(grouped, x, stacked, torch.empty(0), *args)
    for expert, start, size in zip(*args):
        one = torch.empty(size, OUT_FEATURES, dtype=torch.bfloat16)
        torch.ops.servelab_cpu.bf16_linear(one, x[start:start + size], stacked[expert])
        assert torch.equal(grouped[start:start + size], one)


@pytest.mark.skipif(w8a8_unavailable_reason() is not None, reason=str(w8a8_unavailable_reason()))
@pytest.mark.parametrize("experts, sizes", GROUPS)
def test_w8a8_experts_equal_one_call_each(experts, sizes):
    packs = [pack_w8a8(*quantize_int8(w)) for w in matrices(1)]
    stacked = [torch.stack(parts) for parts in zip(*packs)]
    x = torch.randn(sum(sizes), IN_FEATURES) * torch.rand(sum(sizes), 1)
    args = grouped_args(experts, sizes)
    grouped = torch.empty(x.shape[0], OUT_FEATURES)
    torch.ops.servelab_cpu.grouped_w8a8_linear(grouped, x, *stacked, *args)
    for expert, start, size in zip(*args):
        assert torch.equal(grouped[start:start + size], w8a8_linear(x[start:start + size], *packs[expert], OUT_FEATURES))


def test_mismatched_groups_are_refused():
    floats = torch.stack([pack_blocks(w) for w in matrices()])
    with pytest.raises(RuntimeError, match="one start and count per expert"):
        torch.ops.servelab_cpu.grouped_expert_linear(torch.empty(3, OUT_FEATURES), torch.randn(3, IN_FEATURES), floats,
                                                     torch.empty(0), [0, 1], [0], [3])
