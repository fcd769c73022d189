"""Shared Triton helpers for the attention kernels (imports triton; kernel modules only)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.kernels.availability import triton_interpret_enabled


@triton.jit
def mma(a, b, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` with a float32 result; UPCAST computes it on float32 copies.

    UPCAST exists for Triton's CPU interpreter, whose ``tl.dot`` multiplies the raw
    bit patterns of bfloat16 operands (triton-lang/triton#11584); on GPUs it is False.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=INPUT_PRECISION)


@triton.jit
def window_start(pos, WINDOW: tl.constexpr):
    """First context position a query at ``pos`` attends to: ``pos - WINDOW + 1``, at
    least 0 (keys ``pos - WINDOW < k <= pos``); 0 when WINDOW is 0 (full attention)."""
    start = 0
    if WINDOW > 0:
        start = tl.maximum(pos - WINDOW + 1, 0)
    return start


@triton.jit
def load_kv_tile(
    kv_ptr, table_row, start_n, hi, offs_d, d_valid,
    stride_c0, stride_cb, stride_cs, head_off,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, OFFSETS_I64: tl.constexpr,
):
    """Gather keys ``[BLOCK_D, BLOCK_N]`` (transposed) and values ``[BLOCK_N, BLOCK_D]`` of
    context positions ``start_n .. start_n + BLOCK_N`` through a block-table row
    (positions >= hi read as 0); returns (k_t, v, k_pos, k_valid, row_off), ``row_off``
    the positions' row offsets for ``load_kv_scales``.

    Each key is looked up through its own block id, so any block size works (1,
    16, ..., one block per sequence).  Offsets are int32 (fewer registers) unless
    OFFSETS_I64 (caches of 2**31 elements or more).
    """
    k_pos = start_n + tl.arange(0, BLOCK_N)
    k_valid = k_pos < hi
    block_ids = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0)
    if OFFSETS_I64:
        block_ids = block_ids.to(tl.int64)
    row_off = block_ids * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + head_off
    k_t = tl.load(kv_ptr + row_off[None, :] + offs_d[:, None],
                  mask=k_valid[None, :] & d_valid[:, None], other=0.0)
    v = tl.load(kv_ptr + stride_c0 + row_off[:, None] + offs_d[None, :],
                mask=k_valid[:, None] & d_valid[None, :], other=0.0)
    return k_t, v, k_pos, k_valid, row_off


@triton.jit
def load_kv_scales(kv_ptr, row_off, k_valid, stride_c0, HEAD_DIM: tl.constexpr):
    """Key and value scales [BLOCK_N] (float32, 0 where not ``k_valid``) of a quantized
    cache's rows ``row_off``: the 4 bytes after each row's HEAD_DIM values."""
    k_scale = tl.load((kv_ptr + row_off + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=k_valid, other=0.0)
    v_scale = tl.load((kv_ptr + stride_c0 + row_off + HEAD_DIM).to(tl.pointer_type(tl.float32)),
                      mask=k_valid, other=0.0)
    return k_scale, v_scale


def check_launchable(kernel, device: torch.device) -> None:
    """Fail clearly when CPU tensors meet a kernel compiled for the GPU.

    ``triton.jit`` reads TRITON_INTERPRET when the kernel module is imported, so
    setting it later has no effect on kernels already defined.
    """
    if device.type == "cuda":
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "Triton kernels got CPU tensors but were not built for the interpreter: set "
            "TRITON_INTERPRET=1 before importing servelab.kernels' kernel modules (or use CUDA tensors)"
        )


def kv_tile_size(block_d: int, num_warps: int) -> int:
    """Keys per K/V tile: about 32 elements of each tile per thread, in [16, 64].

    From ptxas reports for sm_90 (bf16): larger tiles spill registers, because the
    block-table gather keeps one address per key row.
    """
    return max(16, min(64, 1024 * num_warps // block_d))


def value_stride(kv_cache: torch.Tensor) -> int:
    """The element offset from a slot's key row to its value row: ``stride(0)``, or 0 for a
    cache of keys alone, whose values are its keys (``AttentionSpec.values_are_keys``)."""
    return kv_cache.stride(0) if kv_cache.shape[0] == 2 else 0


def offsets_i64(kv_cache: torch.Tensor) -> bool:
    """True when element offsets into ``kv_cache`` may overflow int32."""
    return kv_cache.numel() >= 2**31


def dot_flags(dtype: torch.dtype) -> dict:
    """Constexpr kwargs for ``mma``: exact fp32 products (no TF32), interpreter bf16 fix."""
    return dict(
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        DOT_UPCAST=triton_interpret_enabled() and dtype == torch.bfloat16,
    )
