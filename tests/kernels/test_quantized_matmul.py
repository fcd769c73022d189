"""quantized_matmul (Triton, weight dequantized inside the K loop) vs the reference:
F.linear with the dequantized weight (kernels/quantized_weights.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelab.kernels.quantized_weights import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8


@pytest.fixture
def matmul():
    """The Triton wrapper (imported lazily: skipped when triton is missing)."""
    return pytest.importorskip("servelab.kernels.quantized_matmul").quantized_matmul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits, group_size", [(8, -1), (4, 32), (4, 64)])
@pytest.mark.parametrize("rows", [1, 19])
def test_matches_dequantize_then_linear(matmul, device, close, bits, group_size, dtype, rows):
    n, k = 72, 128
    weight = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k).to(dtype)
    if bits == 8:
        qweight, scales = quantize_int8(weight)
        scales, zeros = scales.to(dtype), None
        reference = dequantize_int8(qweight, scales, torch.float32)
    else:
        qweight, scales, zeros = quantize_int4(weight, group_size)
        scales, zeros = scales.to(dtype), zeros.to(dtype)
        reference = dequantize_int4(qweight, scales, zeros, torch.float32)
    expected = F.linear(x.float(), reference.to(dtype).float()).to(dtype)
    out = matmul(x.to(device), qweight.to(device), scales.to(device), None if zeros is None else zeros.to(device),
                 group_size)
    assert out.dtype == dtype and out.shape == (rows, n)
    close(out, expected)


def test_refuses_groups_that_straddle_a_tile(matmul, device):
    qweight, scales, zeros = quantize_int4(torch.randn(8, 48), 16)
    with pytest.raises(ValueError, match="group_size=16 must be a multiple of 32"):
        matmul(torch.randn(2, 48, device=device), qweight.to(device), scales.to(device), zeros.to(device), 16)
