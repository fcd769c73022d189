"""Triton kernel: weight-only quantized matmul, the weight dequantized tile by tile inside
the K loop (never whole in memory). ``y = x @ w.T`` with ``w`` in servelab's format
(``servelab/kernels/quantized_weights.py``): int8 with one scale per output channel (applied once
to the accumulator), or int4 in groups whose scale and zero apply to each K tile (a tile
never straddles two groups). The reference is ``F.linear(x, dequantize(w))``
(``QuantizedLinear``'s reference path); tests run this kernel under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.kernels._checks import FLOAT_DTYPES, check, check_runnable, check_same_device
from servelab.kernels._triton_utils import check_launchable, dot_flags, mma

BLOCK_K = 32
"""K tile: divides every int4 group size the wrapper takes (multiples of 32)."""


@triton.jit
def _quantized_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    INT4: tl.constexpr, GROUP_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per [BLOCK_M, BLOCK_N] output tile."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K),
                    other=0.0)
        if INT4:
            bytes_ = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + cols[:, None] * stride_wn + bytes_[None, :], mask=col_ok[:, None], other=0)
            q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))  # even feature = low nibble
            group = k0 // GROUP_SIZE
            scale = tl.load(scale_ptr + cols * stride_sn + group, mask=col_ok, other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + cols * stride_sn + group, mask=col_ok, other=0.0).to(tl.float32)
            w = (q.to(tl.float32) - 8.0) * scale[:, None] + zero[:, None]
        else:
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & (ks[None, :] < K),
                        other=0)
        w = w.to(tl.float32).to(x.dtype)  # integers through float32: the interpreter mis-casts int8 to bfloat16
        acc += mma(x, tl.trans(w), DOT_PRECISION, DOT_UPCAST)
    if not INT4:
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def quantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     group_size: int) -> torch.Tensor:
    """x [M, K] float -> [M, N] in x's dtype. int8: ``qweight`` int8 [N, K], ``scales``
    [N], ``zeros`` None; int4: ``qweight`` uint8 [N, K / 2], ``scales`` and ``zeros``
    [N, K / group_size] with ``group_size`` a multiple of 32. float32 multiplies in IEEE
    float32 (no TF32)."""
    int4 = zeros is not None
    check(x.dim() == 2 and x.stride(-1) == 1, f"x must be [M, K] and contiguous in K, got {tuple(x.shape)}")
    check(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} not in {FLOAT_DTYPES}")
    rows, k = x.shape
    n = qweight.shape[0]
    check(qweight.is_contiguous(), "qweight must be contiguous")
    if int4:
        check(qweight.dtype == torch.uint8 and qweight.shape == (n, k // 2), f"int4 qweight must be uint8 [N, {k // 2}]")
        check(group_size % BLOCK_K == 0 and k % group_size == 0,
              f"group_size={group_size} must be a multiple of {BLOCK_K} that divides K={k}")
        check(scales.shape == zeros.shape == (n, k // group_size) and scales.stride(-1) == 1 and zeros.stride() ==
              scales.stride(), f"scales and zeros must be [N, {k // group_size}] with equal strides")
    else:
        check(qweight.dtype == torch.int8 and qweight.shape == (n, k), f"int8 qweight must be int8 [N, {k}]")
        check(scales.shape == (n,) and scales.is_contiguous(), "int8 scales must be contiguous [N]")
    check_same_device(x.device, qweight=qweight, scales=scales)
    check_runnable(x.device)
    check_launchable(_quantized_matmul_kernel, x.device)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m = 16 if rows <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _quantized_matmul_kernel[grid](
        x, qweight, scales, zeros if int4 else scales, out,
        rows, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        INT4=int4, GROUP_SIZE=group_size if int4 else 1, **dot_flags(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        num_warps=4,
    )
    return out
