"""servelab's int8 x int8 CPU matmul (csrc/w8a8_linear.cpp) against its torch reference
(each row quantized to int8, exact integer dot products, both scales), bit for bit."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.quantized_weights import dequantize_int8, quantize_int8
from servelab.kernels.w8a8_cpu import (ACTIVATION_OFFSET, BLOCK, PACK_CHANNELS, PACK_INPUTS, pack_w8a8,
                                       quantize_rows, w8a8_linear, w8a8_linear_reference, w8a8_unavailable_reason)

needs_kernel = pytest.mark.skipif(w8a8_unavailable_reason() is not None, reason=str(w8a8_unavailable_reason()))

# (out_features, in_features): one channel, K not a multiple of 4 or 16, partial and several tiles.
SHAPES = [(1, 1), (5, 3), (17, 31), (64, 64), (100, 37), (200, 130)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 16, 17, 40]  # the 6-row VNNI tiles; 16-row AMX tiles from 4 rows


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


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_do_not_depend_on_the_batch_and_stay_close_to_float(threads):
    qweight, scales = quantized(4864 // 8, 896, seed=3)
    packed = pack_w8a8(qweight, scales)
    x = torch.randn(16, 896)
    x[3] *= 1000  # an outlier row changes no other row's result
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = w8a8_linear(x, *packed, qweight.shape[0])
        alone = torch.cat([w8a8_linear(x[i:i + 1], *packed, qweight.shape[0]) for i in range(16)])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(batch, alone)
    exact = x @ dequantize_int8(qweight, scales, torch.float32).T
    assert float((batch - exact).norm() / exact.norm()) < 0.01


@needs_kernel
def test_refuses_a_packed_weight_of_the_wrong_layout():
    qweight, scales = quantized(64, 32)
    packed, offsets, padded_scales = pack_w8a8(qweight, scales)
    with pytest.raises(RuntimeError, match="packed must be a contiguous int8"):
        w8a8_linear(torch.randn(2, 68), packed, offsets, padded_scales, 64)
    with pytest.raises(RuntimeError, match="offsets \\(int32\\)"):
        w8a8_linear(torch.randn(2, 32), packed, offsets.float(), padded_scales, 64)
