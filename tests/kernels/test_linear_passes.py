"""Prefill-sized batches through the int8 dot-product matmuls (w8a8, w4a8 and the weight-only
sliced int8 and int4): rows past what fits half a core's L2 go in passes over the weight
(``rows_per_pass`` in csrc/int8_rows.h). A pass boundary changes no result: every row
equals the same row multiplied in a small batch, whatever the threads, for single matrices
and for grouped experts whose rows span several passes."""

from __future__ import annotations

import itertools

import pytest
import torch

from servelab.kernels.quantized_cpu import int8_sliced_linear
from servelab.kernels.quantized_weights import quantize_int4, quantize_int8
from servelab.kernels.w4a8_cpu import int4_sliced_linear, pack_w4a8, w4a8_linear
from servelab.kernels.w8a8_cpu import pack_w8a8, w8a8_linear, w8a8_unavailable_reason

pytestmark = pytest.mark.skipif(w8a8_unavailable_reason() is not None, reason=str(w8a8_unavailable_reason()))

OUT_FEATURES, IN_FEATURES, ROWS = 72, 4096, 600
"""A 4096-wide row is 4 KiB as int8: 600 rows (1800 slice rows) are several passes on any
core with up to 4 MiB of L2 (at most 512 rows of 4 KiB, or 170 rows of three slices)."""
PIECE = 40
"""Rows per small batch: one pass on any core with at least 256 KiB of L2."""

KERNELS = {
    "w8a8": (lambda w: pack_w8a8(*quantize_int8(w)), w8a8_linear),
    "int8-sliced": (lambda w: pack_w8a8(*quantize_int8(w)), int8_sliced_linear),
    "w4a8": (lambda w: pack_w4a8(*quantize_int4(w, 128)), w4a8_linear),
    "int4-sliced": (lambda w: pack_w4a8(*quantize_int4(w, 128)), int4_sliced_linear),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", KERNELS)
def test_rows_in_passes_equal_the_rows_in_small_batches(name, threads, torch_threads):
    pack, multiply = KERNELS[name]
    torch.manual_seed(0)
    packed = pack(torch.randn(OUT_FEATURES, IN_FEATURES))
    x = torch.randn(ROWS, IN_FEATURES) * torch.rand(ROWS, 1)
    torch_threads(threads)
    in_passes = multiply(x, *packed, OUT_FEATURES)
    pieces = torch.cat([multiply(x[i:i + PIECE].clone(), *packed, OUT_FEATURES) for i in range(0, ROWS, PIECE)])
    assert torch.equal(in_passes, pieces)


@pytest.mark.parametrize("op, per_expert", [("grouped_w8a8_linear", w8a8_linear),
                                            ("grouped_int8_sliced_linear", int8_sliced_linear)])
def test_grouped_experts_with_rows_in_passes_equal_one_call_each(op, per_expert):
    torch.manual_seed(1)
    packs = [pack_w8a8(*quantize_int8(torch.randn(OUT_FEATURES, IN_FEATURES))) for _ in range(3)]
    stacked = [torch.stack(parts) for parts in zip(*packs)]
    experts, sizes = [2, 0, 1], [ROWS, 3, 530]
    starts = list(itertools.accumulate(sizes[:-1], initial=0))
    x = torch.randn(sum(sizes), IN_FEATURES)
    grouped = torch.empty(x.shape[0], OUT_FEATURES)
    getattr(torch.ops.servelab_cpu, op)(grouped, x, *stacked, experts, starts, sizes)
    for expert, start, size in zip(experts, starts, sizes):
        alone = torch.cat([per_expert(x[i:i + PIECE].clone(), *packs[expert], OUT_FEATURES)
                           for i in range(start, start + size, PIECE)])
        assert torch.equal(grouped[start:start + size], alone[:size])
