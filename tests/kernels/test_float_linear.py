"""servelab's float32 CPU matmul (csrc/blocked_linear.cpp) against a float64 reference, at
shapes that exercise every partial tile, row remainder, row group, K slice and thread split."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.blocked_linear import BLOCK, PACK_CHANNELS, float_linear, pack_blocks
from servelab.kernels.cpu_ops import native_cpu_unavailable_reason

pytestmark = pytest.mark.skipif(native_cpu_unavailable_reason() is not None,
                                reason=f"native CPU ops: {native_cpu_unavailable_reason()}")

# (out_features, in_features): no inputs, one channel, partial vectors and tiles (one tile: rows split
# into groups across the threads), several tiles, and K past one slice (2048 float32 values
# on AVX-512, 4096 on AVX2) with a partial last slice.
SHAPES = [(3, 0), (1, 1), (5, 3), (17, 31), (64, 64), (100, 37), (200, 130), (70, 4200)]
ROWS = [0, 1, 2, 3, 5, 6, 7, 13, 49, 100]  # none, every remainder of the 6-row (AVX-512) and 3-row (AVX2) tiles


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().T).float()


def test_packing_puts_16_channels_side_by_side_along_k_and_pads_with_zero_channels():
    weight = torch.randn(70, 9)
    packed = pack_blocks(weight)
    assert packed.shape == (2 * PACK_CHANNELS // BLOCK, 9, BLOCK) and packed.dtype == torch.float32
    assert float(packed[1, 4, 3]) == float(weight[BLOCK + 3, 4])
    assert float(packed[4, 2, 5]) == float(weight[4 * BLOCK + 5, 2])
    assert not packed.view(-1, 9 * BLOCK)[70 // BLOCK + 1:].any()


@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_integer_inputs_give_the_exact_dot_product(out_features, in_features, rows):
    """Small integers make every float32 partial sum exact, whatever order the kernel sums
    in and however it splits K: the result must equal the dot product bit for bit."""
    torch.manual_seed(rows)
    weight = torch.randint(-3, 4, (out_features, in_features)).float()
    x = torch.randint(-3, 4, (rows, in_features)).float()
    out = float_linear(x, pack_blocks(weight), out_features)
    assert torch.equal(out, reference(x, weight))


@pytest.mark.parametrize("threads", [1, 3])
def test_random_inputs_match_float64_on_any_thread_count(threads):
    torch.manual_seed(threads)
    weight, x = torch.randn(333, 1100), torch.randn(57, 1100)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = float_linear(x, pack_blocks(weight), 333)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(out, reference(x, weight), rtol=1e-5, atol=1e-4)


def test_refuses_a_packed_weight_of_the_wrong_layout_or_type():
    weight = torch.randn(64, 32)
    with pytest.raises(RuntimeError, match="packed must be a contiguous float32"):
        float_linear(torch.randn(2, 32), weight, 64)
    with pytest.raises(RuntimeError, match="packed must be a contiguous float32"):
        float_linear(torch.randn(2, 32), pack_blocks(weight.double()), 64)
    with pytest.raises(RuntimeError, match="x must be a contiguous float32"):
        float_linear(torch.randn(32, 2).T, pack_blocks(weight), 64)
