"""servelab's int8 x int8 CPU matmul (csrc/w8a8_linear.cpp) against its torch reference
(each row quantized to int8, exact integer dot products, both scales), bit for bit; and
both int8-activation kernels' (w8a8, w4a8) rows independent of the batch."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.quantized_weights import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from servelab.kernels.w4a8_cpu import pack_w4a8, w4a8_linear
from servelab.kernels.w8a8_cpu import (ACTIVATION_OFFSET, BLOCK, PACK_CHANNELS, PACK_INPUTS, pack_w8a8,
                                       quantize_rows, w8a8_linear, w8a8_linear_reference, w8a8_unavailable_reason)

needs_kernel = pytest.mark.skipif(w8a8_unavailable_reason() is not None, reason=str(w8a8_unavailable_reason()))

# (out_features, in_features): one channel, K not a multiple of 4 or 16, partial and several tiles.
SHAPES = [(1, 1), (5, 3), (17, 31), (64, 64), (100, 37), (200, 130)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 16, 17, 40]  # the 6-row VNNI tiles; 16-row AMX tiles from 7 rows


def quantized(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return quantize_int8(torch.randn(out_features, in_features) * torch.rand(out_features, 1))


def test_rows_quantize_to_their_own_scale_and_zero_rows_stay_zero():
    x = torch.tensor([[0.5, -1.27, 0.01], [0.0, 0.0, 0.0], [300.0, 1.0, -2.0]])
    q, step = quantize_rows(x)
    assert q.dtype == torch.int8 and q.tolist() == [[50, -127, 1], [0, 0, 0], [127, 0, -1]]
    torch.testing.assert_close(step, torch.tensor([0.01, 1.0, 300 / 127]))


def test_packing_puts_4_inputs_of_16_channels_in_64_bytes_and_offsets_hold_128_times_the_row_sums():
    qweight, scales = quantized(70, 9)
    packed, offsets, padded_scales = pack_w8a8(qweight, scales)
    assert packed.shape == (2 * PACK_CHANNELS // BLOCK, PACK_INPUTS // 4, 4 * BLOCK) and offsets.dtype == torch.int32
    assert int(packed[1, 1, 4 * 3 + 2]) == int(qweight[BLOCK + 3, 4 + 2])
    assert int(packed[0, 2, 4 * 5 + 0]) == int(qweight[5, 8]) and int(packed[0, 2, 4 * 5 + 1]) == 0
    assert torch.equal(offsets[:70], ACTIVATION_OFFSET * qweight.sum(dim=1, dtype=torch.int32))
    assert not offsets[70:].any() and not padded_scales[70:].any()


@needs_kernel
@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_equals_the_reference_bit_for_bit(out_features, in_features, rows):
    qweight, scales = quantized(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features) * torch.logspace(-3, 3, rows)[:, None]
    x[rows // 2, :] = 0.0  # a zero row
    out = w8a8_linear(x, *pack_w8a8(qweight, scales), out_features)
    assert torch.equal(out, w8a8_linear_reference(x, qweight, scales))


def int8_activation_kernel(mode: str):
    """(weight [N, K] -> packed tensors, packed -> call, weight -> what the kernel's integers
    stand for) of w8a8 or w4a8 (int4 in groups of 128)."""
    if mode == "w8a8":
        return (lambda weight: pack_w8a8(*quantize_int8(weight)), w8a8_linear,
                lambda weight: dequantize_int8(*quantize_int8(weight), torch.float32))
    return (lambda weight: pack_w4a8(*quantize_int4(weight, 128)), w4a8_linear,
            lambda weight: dequantize_int4(*quantize_int4(weight, 128), torch.float32))


@needs_kernel
@pytest.mark.parametrize("mode", ["w8a8", "w4a8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_do_not_depend_on_the_batch_and_stay_close_to_float(mode, threads, torch_threads):
    pack, multiply, dequantized = int8_activation_kernel(mode)
    torch.manual_seed(3)
    weight = torch.randn(4864 // 8, 896) * torch.rand(4864 // 8, 1)
    packed = pack(weight)
    x = torch.randn(16, 896)
    x[3] *= 1000  # an outlier row changes no other row's result
    torch_threads(threads)
    batch = multiply(x, *packed, weight.shape[0])
    alone = torch.cat([multiply(x[i:i + 1], *packed, weight.shape[0]) for i in range(16)])
    assert torch.equal(batch, alone)
    exact = x @ dequantized(weight).T
    assert float((batch - exact).norm() / exact.norm()) < 0.01


@needs_kernel
def test_refuses_a_packed_weight_of_the_wrong_layout():
    qweight, scales = quantized(64, 32)
    packed, offsets, padded_scales = pack_w8a8(qweight, scales)
    with pytest.raises(RuntimeError, match="packed must be a contiguous int8"):
        w8a8_linear(torch.randn(2, 68), packed, offsets, padded_scales, 64)
    with pytest.raises(RuntimeError, match="offsets \\(int32\\)"):
        w8a8_linear(torch.randn(2, 32), packed, offsets.float(), padded_scales, 64)
