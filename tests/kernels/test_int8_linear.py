"""servelab's weight-only int8 CPU matmul (csrc/blocked_linear.cpp) against the dequantized
reference, at shapes that exercise every partial tile, row remainder and thread split."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.blocked_linear import BLOCK, PACK_CHANNELS
from servelab.kernels.cpu_ops import native_cpu_unavailable_reason
from servelab.kernels.quantized_cpu import int8_linear, pack_int8
from servelab.kernels.quantized_weights import dequantize_int8, quantize_int8

pytestmark = pytest.mark.skipif(native_cpu_unavailable_reason() is not None,
                                reason=f"native CPU ops: {native_cpu_unavailable_reason()}")

# (out_features, in_features): one channel, partial vectors and tiles, several tiles.
SHAPES = [(1, 1), (5, 3), (17, 31), (64, 64), (100, 37), (200, 130)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 40]  # every remainder of the 6-row (AVX-512) and 3-row (AVX2) tiles


def quantized(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return quantize_int8(torch.randn(out_features, in_features) * torch.rand(out_features, 1))


def test_packing_puts_16_channels_side_by_side_along_k_and_pads_with_zero_channels():
    qweight, scales = quantized(70, 9)
    packed, padded_scales = pack_int8(qweight, scales)
    assert packed.shape == (2 * PACK_CHANNELS // BLOCK, 9, BLOCK) and padded_scales.shape == (2 * PACK_CHANNELS,)
    assert int(packed[1, 4, 3]) == int(qweight[BLOCK + 3, 4])
    assert int(packed[4, 2, 5]) == int(qweight[4 * BLOCK + 5, 2])
    assert not packed.view(-1, 9 * BLOCK)[70 // BLOCK + 1:].any() and not padded_scales[70:].any()


@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_integer_inputs_give_the_exact_scaled_dot_product(out_features, in_features, rows):
    """Small integer inputs make every float32 partial sum exact: the kernel must return
    round(scale * dot) bit for bit, whatever order it sums in."""
    qweight, scales = quantized(out_features, in_features)
    x = torch.randint(-4, 5, (rows, in_features)).float()
    out = int8_linear(x, *pack_int8(qweight, scales), out_features)
    expected = ((x.double() @ qweight.double().T) * scales.double()).float()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features, in_features, rows", [(200, 130, 7), (4864 // 8, 896, 16), (96, 4864 // 8, 1)])
def test_random_inputs_match_the_dequantized_reference(threads, out_features, in_features, rows):
    qweight, scales = quantized(out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = int8_linear(x, *pack_int8(qweight, scales), out_features)
    finally:
        torch.set_num_threads(previous)
    expected = (x.double() @ dequantize_int8(qweight, scales, torch.float64).T).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_refuses_a_packed_weight_of_the_wrong_layout():
    qweight, scales = quantized(64, 32)
    packed, padded_scales = pack_int8(qweight, scales)
    with pytest.raises(RuntimeError, match="packed must be a contiguous int8"):
        int8_linear(torch.randn(2, 32), qweight, padded_scales, 64)
    with pytest.raises(RuntimeError, match="packed must be a contiguous int8"):
        int8_linear(torch.randn(2, 33), packed, padded_scales, 64)
