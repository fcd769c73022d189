"""servelab's weight-only int8 matmul on int8 dot products (``int8_sliced_linear`` in
csrc/w8a8_linear.cpp): each float32 input row split into three int8 slices. Its results
stay within float32 rounding of the dequantized reference at shapes that exercise every
partial tile, the VNNI row tiles and the tile unit's, carry the row to about 6e-8 of its
largest value (one slice alone would carry 1/254), and do not depend on the batch."""

from __future__ import annotations

import itertools

import pytest
import torch

from servelab.kernels.quantized_cpu import int8_linear, int8_sliced_linear, pack_int8, pack_int8_sliced
from servelab.kernels.quantized_weights import dequantize_int8, quantize_int8
from servelab.kernels.w8a8_cpu import w8a8_unavailable_reason

pytestmark = pytest.mark.skipif(w8a8_unavailable_reason() is not None, reason=str(w8a8_unavailable_reason()))

SHAPES = [(1, 1), (5, 3), (17, 31), (64, 64), (100, 37), (200, 130)]
ROWS = [1, 2, 3, 5, 6, 13, 16, 40]  # VNNI tiles of 6 rows (2 input rows), the tile unit's 16 from 2 input rows


def quantized(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return quantize_int8(torch.randn(out_features, in_features) * torch.rand(out_features, 1))


def reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.double() @ dequantize_int8(qweight, scales, torch.float64).T


@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_results_stay_within_float32_rounding_of_the_reference(out_features, in_features, rows):
    qweight, scales = quantized(out_features, in_features)
    x = torch.randn(rows, in_features) * torch.rand(rows, 1)
    x[:, 0] *= 30  # an outlier input: the slices are scaled to each row's largest value
    out = int8_sliced_linear(x, *pack_int8_sliced(qweight, scales), out_features)
    expected = reference(x, qweight, scales)
    weights = dequantize_int8(qweight, scales, torch.float64).abs()
    # The slices' error (6.2e-8 of the row's largest value per input) and float32 rounding.
    bound = (x.double().abs().amax(dim=1, keepdim=True) * weights.sum(dim=1) * 6.2e-8
             + (x.double().abs() @ weights.T) * 1e-6)
    assert ((out.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_as_accurate_as_widening_the_weights_to_float32(threads):
    """The 0.5B model's MLP shape: the sliced kernel's largest error against the float64
    reference is no larger than ``int8_linear``'s (float32 products and sums)."""
    qweight, scales = quantized(4864 // 8, 896, seed=1)
    x = torch.randn(16, 896)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sliced = int8_sliced_linear(x, *pack_int8_sliced(qweight, scales), qweight.shape[0])
        widened = int8_linear(x, *pack_int8(qweight, scales), qweight.shape[0])
    finally:
        torch.set_num_threads(previous)
    expected = reference(x, qweight, scales)
    assert (sliced.double() - expected).abs().max() <= 1.5 * (widened.double() - expected).abs().max()


def test_three_slices_carry_a_row_to_6e_8_of_its_largest_value():
    """Through the identity (127 * I with scale 1/127) the output is the row as the slices
    hold it: within max |x| / (2 * 127 * 254^2) plus float32 rounding, where one int8
    slice would be off by up to max |x| / 254."""
    width = 96
    qweight, scales = torch.eye(width, dtype=torch.int8) * 127, torch.full((width,), 1 / 127)
    torch.manual_seed(3)
    x = torch.randn(5, width) * torch.tensor([[1e-3], [1.0], [7.0], [1e4], [0.0]])
    out = int8_sliced_linear(x, *pack_int8_sliced(qweight, scales), width)
    largest = x.abs().amax(dim=1, keepdim=True)
    assert ((out - x).abs() <= largest * (1 / (2 * 127 * 254 ** 2) + 3e-7)).all()
    assert not out[4].any()  # a zero row gives zeros


def test_a_row_gives_the_same_result_alone_and_in_any_batch():
    """Each row's slices are its own and every path sums the same exact integer products,
    so one row alone (VNNI), beside one other (the tile unit where the CPU has one) and
    among 40 gives the same floats."""
    qweight, scales = quantized(130, 200, seed=2)
    packed = pack_int8_sliced(qweight, scales)
    x = torch.randn(40, 200)
    batch = int8_sliced_linear(x, *packed, 130)
    for i, j in itertools.pairwise([0, 1, 2, 7, 40]):
        assert torch.equal(int8_sliced_linear(x[i:j].clone(), *packed, 130), batch[i:j])


def test_grouped_experts_equal_one_call_each():
    torch.manual_seed(4)
    packs = [pack_int8_sliced(*quantize_int8(torch.randn(72, 40))) for _ in range(5)]
    stacked = [torch.stack(parts) for parts in zip(*packs)]
    experts, sizes = [4, 0, 1], [5, 1, 17]
    starts = list(itertools.accumulate(sizes[:-1], initial=0))
    x = torch.randn(sum(sizes), 40)
    grouped = torch.empty(x.shape[0], 72)
    torch.ops.servelab_cpu.grouped_int8_sliced_linear(grouped, x, *stacked, experts, starts, sizes)
    for expert, start, size in zip(experts, starts, sizes):
        assert torch.equal(grouped[start:start + size], int8_sliced_linear(x[start:start + size], *packs[expert], 72))


def test_refuses_a_packed_weight_of_the_wrong_layout():
    qweight, scales = quantized(64, 32)
    packed, offsets, padded_scales = pack_int8_sliced(qweight, scales)
    blocked, _ = pack_int8(qweight, scales)
    with pytest.raises(RuntimeError, match="int8_sliced_linear: packed must be a contiguous int8"):
        int8_sliced_linear(torch.randn(2, 32), blocked, offsets, padded_scales, 64)
    with pytest.raises(RuntimeError, match="int8_sliced_linear: x must be a contiguous float32"):
        int8_sliced_linear(torch.randn(2, 32).double(), packed, offsets, padded_scales, 64)
