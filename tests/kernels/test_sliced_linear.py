"""servelab's weight-only int8 and int4 matmuls on int8 dot products (``int8_sliced_linear``
on w8a8's packed weight, ``int4_sliced_linear`` on w4a8's): each float32 input row split
into three int8 slices (int8) or two (int4). Their results stay within the slices' error
and float32 rounding of the dequantized reference at shapes that exercise every partial
tile, the VNNI row tiles and the tile unit's; int8's are no less accurate than the kernel
that widens the weights to float32 and carry the row to about 6e-8 of its largest value
(one slice alone would carry 1/254); int4's two slices add a small fraction to the error
of rounding the weights to 4 bits; no result depends on the batch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from servelab.kernels.int4_cpu import int4_linear, pack_int4_blocks
from servelab.kernels.quantized_cpu import int8_linear, int8_sliced_linear, pack_int8
from servelab.kernels.quantized_weights import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from servelab.kernels.w4a8_cpu import int4_sliced_linear, pack_w4a8
from servelab.kernels.w8a8_cpu import pack_w8a8, w8a8_unavailable_reason

pytestmark = pytest.mark.skipif(w8a8_unavailable_reason() is not None, reason=str(w8a8_unavailable_reason()))


@dataclass(frozen=True)
class Kernel:
    """A sliced kernel with its weight format: quantize a float weight (to ``quantized``),
    dequantize it, pack it for the sliced kernel and for the widening one."""

    name: str
    quantize: Callable
    dequantize: Callable
    pack: Callable
    sliced: Callable
    pack_widened: Callable
    widened: Callable
    shapes: tuple  # (out_features, in_features)
    slice_error: float  # the slices' error per input, of the row's largest value: 1 / (2 * 127 * 254^(slices - 1))

    def __str__(self) -> str:
        return self.name


def int4_in_groups(weight: torch.Tensor) -> tuple:
    """int4 in groups of 64 where the width allows (the tile unit's groups), else of 8."""
    return quantize_int4(weight, 64 if weight.shape[1] % 64 == 0 else 8)


INT8 = Kernel("int8", quantize_int8, dequantize_int8, pack_w8a8, int8_sliced_linear, pack_int8, int8_linear,
              ((1, 1), (5, 3), (17, 31), (64, 64), (100, 37), (200, 130)), 6.2e-8)
INT4 = Kernel("int4", int4_in_groups, dequantize_int4, pack_w4a8, int4_sliced_linear, pack_int4_blocks, int4_linear,
              ((1, 8), (5, 16), (17, 48), (64, 64), (100, 96), (200, 128)), 1.56e-5)
KERNELS = [INT8, INT4]
ROWS = [1, 2, 3, 4, 5, 6, 13, 16, 40, 170]
"""VNNI tiles of a few slice rows; the tile unit's 16 from 3 (int8) or 4 (int4) rows, up to
prefill-sized batches."""


def quantized(kernel: Kernel, out_features: int, in_features: int, seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    return kernel.quantize(torch.randn(out_features, in_features) * torch.rand(out_features, 1))


@pytest.mark.parametrize("kernel, shape", [(k, s) for k in KERNELS for s in k.shapes], ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_results_stay_within_the_slices_error_of_the_reference(kernel, shape, rows):
    out_features, in_features = shape
    weight = quantized(kernel, out_features, in_features)
    x = torch.randn(rows, in_features) * torch.rand(rows, 1)
    x[:, 0] *= 30  # an outlier input: the slices are scaled to each row's largest value
    out = kernel.sliced(x, *kernel.pack(*weight), out_features)
    dequantized = kernel.dequantize(*weight, torch.float64)
    expected = x.double() @ dequantized.T
    # The slices' error (a share of the row's largest value per input) and float32 rounding.
    bound = (x.double().abs().amax(dim=1, keepdim=True) * dequantized.abs().sum(dim=1) * kernel.slice_error
             + (x.double().abs() @ dequantized.abs().T) * 1e-6)
    assert ((out.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_int8_is_as_accurate_as_widening_the_weights_to_float32(threads):
    """The 0.5B model's MLP shape, 16 rows: the sliced kernel's largest error against the
    float64 product of the dequantized weight is no larger than the widening kernel's
    (float32 products and sums)."""
    kernel = INT8
    weight = quantized(kernel, 4864 // 8, 896, seed=1)
    out_features = weight[0].shape[0]
    x = torch.randn(16, 896)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sliced = kernel.sliced(x, *kernel.pack(*weight), out_features)
        widened = kernel.widened(x, *kernel.pack_widened(*weight), out_features)
    finally:
        torch.set_num_threads(previous)
    expected = x.double() @ kernel.dequantize(*weight, torch.float64).T
    assert (sliced.double() - expected).abs().max() <= 1.5 * (widened.double() - expected).abs().max()


@pytest.mark.parametrize("threads", [1, 2])
def test_int4s_two_slices_add_little_to_the_error_of_4_bit_weights(threads):
    """The 0.5B model's MLP shape, 16 rows of activations with outliers: the sliced
    kernel's error against the float64 product of the dequantized weight is under 1% of
    what rounding the float weight to int4 changes in the product."""
    torch.manual_seed(1)
    weight = torch.randn(4864 // 8, 896) * 0.02
    quantized_weight = quantize_int4(weight, 128)
    x = torch.randn(16, 896)
    x[:, :4] *= 40  # a few large inputs: the slices' steps follow each row's largest value
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sliced = int4_sliced_linear(x, *pack_w4a8(*quantized_weight), weight.shape[0]).double()
    finally:
        torch.set_num_threads(previous)
    dequantized = x.double() @ dequantize_int4(*quantized_weight, torch.float64).T
    rounding = (dequantized - x.double() @ weight.double().T).norm()
    assert (sliced - dequantized).norm() < 0.01 * rounding


def test_three_slices_carry_a_row_to_6e_8_of_its_largest_value():
    """Through the identity (int8 127 * I with scale 1/127) the output is the row as the
    slices hold it: within max |x| / (2 * 127 * 254^2) plus float32 rounding, where one
    int8 slice would be off by up to max |x| / 254."""
    width = 96
    qweight, scales = torch.eye(width, dtype=torch.int8) * 127, torch.full((width,), 1 / 127)
    torch.manual_seed(3)
    x = torch.randn(5, width) * torch.tensor([[1e-3], [1.0], [7.0], [1e4], [0.0]])
    out = int8_sliced_linear(x, *pack_w8a8(qweight, scales), width)
    largest = x.abs().amax(dim=1, keepdim=True)
    assert ((out - x).abs() <= largest * (1 / (2 * 127 * 254 ** 2) + 3e-7)).all()
    assert not out[4].any()  # a zero row gives zeros


@pytest.mark.parametrize("kernel", KERNELS, ids=str)
def test_a_row_gives_the_same_result_alone_and_in_any_batch(kernel):
    """Each row's slices are its own and every path sums the same exact integer products,
    so one row alone (VNNI), beside a few others (the tile unit where the CPU has one)
    and among 170 gives the same floats."""
    weight = quantized(kernel, 130, 192, seed=2)
    packed = kernel.pack(*weight)
    x = torch.randn(170, 192)
    batch = kernel.sliced(x, *packed, 130)
    for i, j in itertools.pairwise([0, 1, 2, 7, 40, 90, 170]):
        assert torch.equal(kernel.sliced(x[i:j].clone(), *packed, 130), batch[i:j])


def test_grouped_int8_experts_equal_one_call_each():
    torch.manual_seed(4)
    packs = [pack_w8a8(*quantize_int8(torch.randn(72, 40))) for _ in range(5)]
    stacked = [torch.stack(parts) for parts in zip(*packs)]
    experts, sizes = [4, 0, 1], [5, 1, 17]
    starts = list(itertools.accumulate(sizes[:-1], initial=0))
    x = torch.randn(sum(sizes), 40)
    grouped = torch.empty(x.shape[0], 72)
    torch.ops.servelab_cpu.grouped_int8_sliced_linear(grouped, x, *stacked, experts, starts, sizes)
    for expert, start, size in zip(experts, starts, sizes):
        assert torch.equal(grouped[start:start + size], int8_sliced_linear(x[start:start + size], *packs[expert], 72))


def test_weights_of_the_wrong_layout_are_refused():
    qweight, scales = quantized(INT8, 64, 32)
    packed, offsets, padded_scales = pack_w8a8(qweight, scales)
    blocked, _ = pack_int8(qweight, scales)
    with pytest.raises(RuntimeError, match="int8_sliced_linear: packed must be a contiguous int8"):
        int8_sliced_linear(torch.randn(2, 32), blocked, offsets, padded_scales, 64)
    with pytest.raises(RuntimeError, match="int8_sliced_linear: x must be a contiguous float32"):
        int8_sliced_linear(torch.randn(2, 32).double(), packed, offsets, padded_scales, 64)
    weight = quantized(INT4, 64, 64)
    with pytest.raises(RuntimeError, match="int4_sliced_linear: packed must be a contiguous uint8"):
        int4_sliced_linear(torch.randn(2, 64), *pack_int4_blocks(*weight), 64)
