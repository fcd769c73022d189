"""Triton kernel: the low-rank matmuls of many LoRA adapters in one launch, segmented and
gathered in the style of Punica's SGMV.

A step's tokens come in segments (one per request: consecutive rows of ``x``), each with
the adapter slot it runs with (-1: none). A program of ``_segment_matmul_kernel`` takes one
segment and one BLOCK_N column tile: it walks the segment's rows BLOCK_M at a time,
multiplies them by its slot's weight tile (gathered by slot index from the stacked
[slots, K, N] weights) and writes, or adds to, the output rows. ``LoRALinear`` calls it
twice per projection on CUDA: ``x @ A`` into a [T, rank] buffer (shrink), then that times
``B`` added to the base layer's output (expand), whatever the number of adapters in the
step. Nothing here reads tensor values on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.kernels._checks import FLOAT_DTYPES, check, check_runnable, check_same_device
from servelab.kernels._triton_utils import check_launchable, dot_flags, mma
from servelab.kernels.availability import triton_interpret_enabled


@triton.jit
def _segment_matmul_kernel(
    x_ptr, w_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr,
    N, K,
    stride_xm, stride_ws, stride_wk, stride_wn, stride_om,
    ACCUMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[rows, cols] (+)= x[rows] @ w[slot][:, cols] for one segment's rows and one
    BLOCK_N column tile; segments of slot -1 are skipped."""
    segment = tl.program_id(0)
    slot = tl.load(seg_slots_ptr + segment)
    if slot < 0:
        return
    start = tl.load(seg_starts_ptr + segment)
    end = tl.load(seg_starts_ptr + segment + 1)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_tile = w_ptr + slot.to(tl.int64) * stride_ws + cols[None, :] * stride_wn
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_tile + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += mma(a, w, DOT_PRECISION, DOT_UPCAST)
        out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if ACCUMULATE:
            acc += tl.load(out_rows, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_rows, acc.to(out_ptr.dtype.element_ty), mask=mask)


def tile_sizes(n: int) -> dict:
    """16-row tiles (decode segments are one row; prefill ones walk down), N tiles up to
    64 wide; small tiles in the interpreter, so tests cross tile edges."""
    if triton_interpret_enabled():
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1)
    return dict(BLOCK_M=16, BLOCK_N=min(64, max(16, triton.next_power_of_2(n))), BLOCK_K=64, num_warps=4,
                num_stages=2)


def _check_inputs(x, weights, seg_starts, seg_slots, out) -> None:
    check(x.dim() == 2 and x.stride(-1) == 1, f"x must be [T, K] and contiguous in K, got {tuple(x.shape)}")
    check(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} not in {FLOAT_DTYPES}")
    check(weights.dim() == 3 and weights.shape[1] == x.shape[1],
          f"weights must be [slots, K={x.shape[1]}, N], got {tuple(weights.shape)}")
    check(weights.dtype == x.dtype, f"weights dtype {weights.dtype} != x dtype {x.dtype}")
    check(seg_starts.dim() == 1 and seg_slots.dim() == 1 and seg_starts.shape[0] == seg_slots.shape[0] + 1,
          f"seg_starts must be [R + 1] and seg_slots [R], got {tuple(seg_starts.shape)} and "
          f"{tuple(seg_slots.shape)}")
    check(seg_starts.dtype == torch.int32 and seg_slots.dtype == torch.int32,
          f"seg_starts and seg_slots must be int32, got {seg_starts.dtype} and {seg_slots.dtype}")
    if out is not None:
        check(out.shape == (x.shape[0], weights.shape[2]) and out.stride(-1) == 1,
              f"out must be [T={x.shape[0]}, N={weights.shape[2]}] and contiguous in N, got {tuple(out.shape)}")
        check(out.dtype in FLOAT_DTYPES, f"out dtype {out.dtype} not in {FLOAT_DTYPES}")
    check_same_device(x.device, weights=weights, seg_starts=seg_starts, seg_slots=seg_slots,
                      **({} if out is None else {"out": out}))


def lora_segment_matmul(x: torch.Tensor, weights: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> out [T, N]: rows ``seg_starts[i] .. seg_starts[i + 1] - 1`` of ``x`` times
    ``weights[seg_slots[i]]`` ([slots, K, N], x's dtype), added to ``out`` when given (any
    float dtype; rows of slot -1 segments untouched), else written to a new x-dtype tensor
    (zeros in those rows). Segments must lie in [0, T] in order; slots in [-1, slots).
    Products accumulate in float32; float32 inputs multiply in IEEE float32 (no TF32)."""
    _check_inputs(x, weights, seg_starts, seg_slots, out)
    check_runnable(x.device)
    check_launchable(_segment_matmul_kernel, x.device)
    n, k = weights.shape[2], weights.shape[1]
    accumulate = out is not None
    if out is None:
        out = torch.zeros(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or seg_slots.shape[0] == 0 or n == 0:
        return out
    tiles = tile_sizes(n)
    grid = (seg_slots.shape[0], triton.cdiv(n, tiles["BLOCK_N"]))
    _segment_matmul_kernel[grid](
        x, weights, out, seg_starts, seg_slots,
        n, k,
        x.stride(0), weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0),
        ACCUMULATE=accumulate, **dot_flags(x.dtype), **tiles,
    )
    return out
