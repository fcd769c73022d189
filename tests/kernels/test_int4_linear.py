"""servelab's weight-only int4 CPU matmul (csrc/int4_linear.cpp) against the dequantized
reference, at shapes that exercise partial tiles, every row remainder of both paths (few
rows: nibbles widened in registers; more: a dequantized K slice), group sizes down to 2,
several K slices and the thread split."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.blocked_linear import BLOCK, PACK_CHANNELS
from servelab.kernels.cpu_ops import native_cpu_unavailable_reason
from servelab.kernels.int4_cpu import int4_linear, pack_int4_blocks
from servelab.kernels.quantized_weights import INT4_OFFSET, dequantize_int4, quantize_int4

pytestmark = pytest.mark.skipif(native_cpu_unavailable_reason() is not None,
                                reason=f"native CPU ops: {native_cpu_unavailable_reason()}")

# (out_features, in_features, group_size): one channel, odd channel counts, groups of 2 and
# of 6 (not a multiple of a vector), one group per row, several tiles, and K past one
# dequantized slice (8192 values per tile) in groups that do not fill it.
SHAPES = [(1, 2, 2), (5, 12, 6), (17, 36, 6), (33, 64, 64), (100, 96, 32), (130, 256, 128), (70, 1536, 96)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 13, 17]  # the 3- and 2-row register paths and the 6- and 3-row float tiles


def quantized(out_features: int, in_features: int, group_size: int, seed: int = 0):
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features) * torch.rand(out_features, 1)
    return quantize_int4(weight, group_size)


def reference(x: torch.Tensor, qweight, scales, zeros) -> torch.Tensor:
    return (x.double() @ dequantize_int4(qweight, scales, zeros, torch.float64).T).float()


def test_packing_puts_16_channels_side_by_side_and_folds_the_zero_into_an_offset():
    qweight, scales, zeros = quantized(70, 12, 6)
    packed, params = pack_int4_blocks(qweight, scales, zeros)
    assert packed.shape == (2 * PACK_CHANNELS // BLOCK, 6, BLOCK) and packed.dtype == torch.uint8
    assert params.shape == (2 * PACK_CHANNELS // BLOCK, 2, 2, BLOCK) and params.dtype == torch.float32
    assert int(packed[1, 4, 3]) == int(qweight[BLOCK + 3, 4])
    assert float(params[4, 1, 0, 5]) == float(scales[4 * BLOCK + 5, 1])
    torch.testing.assert_close(params[4, 1, 1, 5], zeros[4 * BLOCK + 5, 1] - INT4_OFFSET * scales[4 * BLOCK + 5, 1])
    assert not packed.view(-1, 6 * BLOCK)[70 // BLOCK + 1:].any() and not params[70 // BLOCK + 1:].any()


@pytest.mark.parametrize("out_features, in_features, group_size", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_matches_the_dequantized_reference(out_features, in_features, group_size, rows):
    qweight, scales, zeros = quantized(out_features, in_features, group_size, seed=rows)
    x = torch.randn(rows, in_features)
    out = int4_linear(x, *pack_int4_blocks(qweight, scales, zeros), out_features)
    expected = reference(x, qweight, scales, zeros)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_threads_split_the_work_without_changing_the_result(threads, rows):
    qweight, scales, zeros = quantized(4864 // 8, 896, 128, seed=rows)
    packed = pack_int4_blocks(qweight, scales, zeros)
    x = torch.randn(rows, 896)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = int4_linear(x, *packed, qweight.shape[0])
        alone = torch.cat([int4_linear(x[i:i + 1], *packed, qweight.shape[0]) for i in range(rows)])
    finally:
        torch.set_num_threads(previous)
    expected = reference(x, qweight, scales, zeros)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    torch.testing.assert_close(alone, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_refuses_tensors_of_the_wrong_layout():
    qweight, scales, zeros = quantized(64, 32, 16)
    packed, params = pack_int4_blocks(qweight, scales, zeros)
    with pytest.raises(RuntimeError, match="packed must be a contiguous uint8"):
        int4_linear(torch.randn(2, 32), qweight, params, 64)
    with pytest.raises(RuntimeError, match="packed must be a contiguous uint8"):
        int4_linear(torch.randn(2, 34), packed, params, 64)
    with pytest.raises(RuntimeError, match="params must be a contiguous float32"):
        int4_linear(torch.randn(2, 32), packed, params[:, :, :1].contiguous(), 64)
