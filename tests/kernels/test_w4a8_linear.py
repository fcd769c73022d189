"""servelab's int4 x int8 CPU matmul (csrc/w4a8_linear.cpp) against its torch reference
(each row quantized to int8, exact integer dot products with the nibbles per group, the
group's scale and offset, the row's scale); its rows' independence of the batch is tested
with w8a8's in test_w8a8_linear.py."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.quantized_weights import quantize_int4, unpack_int4
from servelab.kernels.w4a8_cpu import pack_w4a8, w4a8_linear, w4a8_linear_reference
from servelab.kernels.w8a8_cpu import w8a8_unavailable_reason

needs_kernel = pytest.mark.skipif(w8a8_unavailable_reason() is not None, reason=str(w8a8_unavailable_reason()))

# (out_features, in_features, group): one channel, one group of 8, partial and several tiles;
# groups of multiples of 64 take the tile unit from 8 rows where the CPU has one.
SHAPES = [(1, 8, 8), (5, 16, 8), (17, 48, 16), (64, 64, 32), (100, 96, 96), (200, 256, 128), (130, 192, 64)]
ROWS = [0, 1, 2, 3, 4, 7, 8, 9, 16, 17, 40]  # 3-row VNNI tiles and their remainders; 16-row AMX tiles from 8


def quantized(out_features: int, in_features: int, group: int, seed: int = 0):
    torch.manual_seed(seed)
    return quantize_int4(torch.randn(out_features, in_features) * torch.rand(out_features, 1), group)


def test_packing_puts_8_inputs_of_16_channels_in_64_bytes():
    qweight, scales, zeros = quantized(70, 16, 8)
    q = unpack_int4(qweight)
    packed, params = pack_w4a8(qweight, scales, zeros)
    assert packed.shape == (128 // 16, 16 // 8, 64) and packed.dtype == torch.uint8
    channel, step, i = 16 * 4 + 3, 1, 2  # block 4, channel 3
    assert int(packed[4, step, 4 * 3 + i]) == int(q[channel, 8 * step + i]) | int(q[channel, 8 * step + 4 + i]) << 4
    channel = 16 * 2 + 5
    assert int(packed[2, 0, 4 * 5 + 1]) == int(q[channel, 1]) | int(q[channel, 5]) << 4
    assert not packed[5:].any()  # channels 80.. are padding
    assert params.shape == (128 // 16, 2, 2, 16) and float(params[0, 1, 0, 7]) == float(scales[7, 1])


@needs_kernel
@pytest.mark.parametrize("out_features, in_features, group", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_equals_the_reference(out_features, in_features, group, rows):
    qweight, scales, zeros = quantized(out_features, in_features, group, seed=rows)
    x = torch.randn(rows, in_features) * torch.logspace(-3, 3, rows)[:, None]
    if rows:
        x[rows // 2, :] = 0.0  # a zero row
    out = w4a8_linear(x, *pack_w4a8(qweight, scales, zeros), out_features)
    reference = w4a8_linear_reference(x, qweight, scales, zeros)
    assert out.shape == (rows, out_features)
    # The same integer dot products; only the float32 sums of the groups round differently.
    largest = float(reference.abs().amax()) if rows else 1.0
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * largest)


@needs_kernel
def test_refuses_a_packed_weight_of_the_wrong_layout_or_group():
    qweight, scales, zeros = quantized(64, 32, 8)
    packed, params = pack_w4a8(qweight, scales, zeros)
    with pytest.raises(RuntimeError, match="packed must be a contiguous uint8"):
        w4a8_linear(torch.randn(2, 40), packed, params, 64)
    qweight, scales, zeros = quantized(64, 32, 4)
    packed, params = pack_w4a8(qweight, scales, zeros)
    with pytest.raises(RuntimeError, match="group that is a multiple of 8"):
        w4a8_linear(torch.randn(2, 32), packed, params, 64)
