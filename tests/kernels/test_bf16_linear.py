"""servelab's bfloat16-weight CPU matmul (``bf16_linear``, csrc/blocked_linear.cpp): the
float32 kernel's tile over bfloat16 weights widened in registers, for float32 rows and for
bfloat16 rows (widened first, the float32 sums rounded once)."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.blocked_linear import pack_blocks
from servelab.kernels.cpu_ops import native_cpu_ops, native_cpu_unavailable_reason

pytestmark = pytest.mark.skipif(native_cpu_unavailable_reason() is not None,
                                reason=f"native CPU ops: {native_cpu_unavailable_reason()}")

# no inputs, partial vectors and tiles, several tiles, and K past one slice (4096 bfloat16
# values) with a partial last slice.
SHAPES = [(3, 0), (5, 3), (17, 31), (200, 130), (70, 4200)]
ROWS = [0, 1, 5, 6, 7, 16, 49]


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    out = x.new_empty(x.shape[0], out_features)
    native_cpu_ops().bf16_linear(out, x, packed)
    return out


@pytest.mark.parametrize("out_features, in_features", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_integer_inputs_give_the_exact_dot_product(out_features, in_features, rows):
    """Small integers are exact in bfloat16 and every float32 partial sum of them exact: the
    result equals the dot product bit for bit, for float32 and bfloat16 rows."""
    torch.manual_seed(rows)
    weight = torch.randint(-3, 4, (out_features, in_features)).bfloat16()
    x = torch.randint(-3, 4, (rows, in_features)).float()
    exact = (x.double() @ weight.double().T).float()
    packed = pack_blocks(weight)
    assert packed.dtype == torch.bfloat16
    assert torch.equal(bf16_linear(x, packed, out_features), exact)
    assert torch.equal(bf16_linear(x.bfloat16(), packed, out_features), exact.bfloat16())


@pytest.mark.parametrize("rows", [1, 7, 16])
def test_bfloat16_rows_are_the_float32_sums_rounded_once(rows):
    """Random values: float32 rows match a float64 reference over the bfloat16 weights, and
    bfloat16 rows give exactly the float32 result of their widened values, rounded once."""
    torch.manual_seed(rows)
    weight, x = torch.randn(333, 1100).bfloat16(), torch.randn(rows, 1100).bfloat16()
    packed = pack_blocks(weight)
    wide = bf16_linear(x.float(), packed, 333)
    torch.testing.assert_close(wide, (x.double() @ weight.double().T).float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(bf16_linear(x, packed, 333), wide.bfloat16())


def test_refuses_mixed_dtypes_and_a_packed_weight_of_the_wrong_type():
    weight = torch.randn(64, 32).bfloat16()
    with pytest.raises(RuntimeError, match="packed must be a contiguous bfloat16"):
        bf16_linear(torch.randn(2, 32), pack_blocks(weight.float()), 64)
    with pytest.raises(RuntimeError, match="one dtype"):
        native_cpu_ops().bf16_linear(torch.empty(2, 64), torch.randn(2, 32).bfloat16(), pack_blocks(weight))
    with pytest.raises(RuntimeError, match="x must be a contiguous float32 or bfloat16"):
        native_cpu_ops().bf16_linear(torch.empty(2, 64).half(), torch.randn(2, 32).half(), pack_blocks(weight))
