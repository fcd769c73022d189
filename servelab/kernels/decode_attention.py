"""Triton kernels: flash-decoding (split-K) attention for batches of single-token queries.

Decode has one query token per request, so a FlashAttention grid over
(requests x heads) leaves most of a big GPU idle for small batches and long
contexts.  Here each request's context -- with a sliding window, only the
window's last W keys -- is cut into ``num_splits`` chunks:
kernel 1 runs one program per (request, KV head, split) -- the GQA heads of
the KV head are the rows of its tile -- and writes a partial normalised output
and its log-sum-exp; kernel 2 merges the splits of each (request, head).
The reference is ``varlen_paged_attention_reference`` with query_len = 1.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from servelab.core.kv_cache_dtype import is_quantized
from servelab.kernels._checks import (
    FLOAT_DTYPES,
    check,
    check_attention_out,
    check_block_table,
    check_cache_dtype,
    check_index_tensor,
    check_kv_cache,
    check_runnable,
    check_same_device,
    next_pow2,
    window_constexpr,
)
from servelab.kernels._triton_utils import (
    check_launchable,
    dot_flags,
    kv_tile_size,
    load_kv_scales,
    load_kv_tile,
    mma,
    offsets_i64,
    value_stride,
    window_start,
)
from servelab.kernels.availability import triton_interpret_enabled
from servelab.kernels.varlen_attention_reference import varlen_paged_attention_reference

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "choose_num_splits"]

LOG2E = math.log2(math.e)
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, seq_lens_ptr, block_table_ptr, part_out_ptr, part_lse_ptr,
    qk_scale_log2, tokens_per_split,
    stride_qr, stride_qh,                        # q [R, H, D]
    stride_c0, stride_cb, stride_cs, stride_ch,  # kv_cache [2, blocks, block_size, Hkv, D]
    stride_bt,                                   # block_table [R, max_blocks]
    stride_pr, stride_ph, stride_ps,             # part_out [R, H, S, BLOCK_D]; part_lse [R, H, S]
    stride_lr, stride_lh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, OFFSETS_I64: tl.constexpr,
    QUANTIZED: tl.constexpr,                     # int8 / float8 cache rows: D values, then a float32 scale
    WINDOW: tl.constexpr,                        # sliding window; 0: full attention
):
    """Grid (requests, KV heads, splits): attention of a KV group's heads over one split
    of the keys from the window start to the context's end."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    lo = window_start(seq_len - 1, WINDOW) + split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + offs_h
    row_valid = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(q_ptr + req.to(tl.int64) * stride_qr + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    for start_n in range(lo, hi, BLOCK_N):
        k_t, v, k_pos, k_valid, row_off = load_kv_tile(
            kv_ptr, table_row, start_n, hi, offs_d, d_valid, stride_c0, stride_cb, stride_cs, head_off,
            BLOCK_SIZE, BLOCK_N, OFFSETS_I64)
        if QUANTIZED:  # one-byte values to q's dtype (exact), their scales applied to scores and weights
            k_scale, v_scale = load_kv_scales(kv_ptr, row_off, k_valid, stride_c0, HEAD_DIM)
            k_t = k_t.to(tl.float32).to(q.dtype)  # through float32: the interpreter's int8 -> bfloat16 is wrong
            v = v.to(tl.float32).to(q.dtype)
        s = mma(q, k_t, DOT_PRECISION, DOT_UPCAST) * qk_scale_log2
        if QUANTIZED:
            s = s * k_scale[None, :]
        s = tl.where(k_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANTIZED:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    has_keys = l_i > 0.0  # False for splits beyond the context
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    part = req.to(tl.int64) * stride_pr + head[:, None] * stride_ph + split * stride_ps + offs_d[None, :]
    tl.store(part_out_ptr + part, acc, mask=row_valid[:, None])
    tl.store(part_lse_ptr + req.to(tl.int64) * stride_lr + head * stride_lh + split, lse, mask=row_valid)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, tokens_per_split,
    stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, stride_or, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Grid (requests, heads): merge the splits' partial outputs by their log-sum-exps."""
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    used = tl.minimum(tl.cdiv(seq_len - window_start(seq_len - 1, WINDOW), tokens_per_split), NUM_SPLITS)
    offs_s = tl.arange(0, BLOCK_S)
    s_valid = offs_s < used
    lse = tl.load(part_lse_ptr + req * stride_lr + head * stride_lh + offs_s, mask=s_valid,
                  other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = tl.where(s_valid, weights, 0.0)
    offs_d = tl.arange(0, BLOCK_D)
    part = req * stride_pr + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    acc = tl.load(part_out_ptr + part, mask=s_valid[:, None], other=0.0)
    res = tl.sum(acc * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + req * stride_or + head * stride_oh + offs_d,
             res.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a small stand-in under the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(max_seq_len: int, num_reqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per sequence: enough programs to fill the GPU, yet each split >= min_tokens tokens.

    With many requests (R x Hkv >= 4 x SMs) one split per sequence already fills
    the device; with few long sequences splits of a few hundred tokens spread them.
    """
    min_tokens = 32 if triton_interpret_enabled() else 256
    by_length = triton.cdiv(max(max_seq_len, 1), min_tokens)
    by_occupancy = triton.cdiv(4 * _num_sms(device), max(num_reqs * num_kv_heads, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Single-token decode attention (flash-decoding); returns [R, H, D].

    q: [R, H, D] (request r's one new token, position seq_lens[r] - 1);
    kv_cache: [2, num_blocks, block_size, Hkv, D]; seq_lens: int32 [R];
    block_table: int32 [R, max_blocks].  max_seq_len: host int, an upper bound of
    every seq_lens entry (keys past it are not read; no GPU sync checks it), which
    sizes the splits; default: the block table's capacity.  num_splits overrides
    the heuristic in ``choose_num_splits``.  out: optional [R, H, D].  sliding_window:
    W reads only each sequence's last W keys (split among the programs), none before.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    check(q.dim() == 3, f"q must be [R, H, D], got {tuple(q.shape)}")
    num_reqs, num_heads, q_head_dim = q.shape
    check(q_head_dim == head_dim, f"q head_dim {q_head_dim} != kv_cache head_dim {head_dim}")
    check(num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    check(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype} must be one of {FLOAT_DTYPES}")
    check_cache_dtype(kv_cache, q.dtype, "q")
    check(q.stride(-1) == 1, "q must be contiguous in head_dim")
    check_index_tensor(seq_lens, "seq_lens", (num_reqs,), torch.int32)
    check_block_table(block_table, num_reqs)
    device = q.device
    check_same_device(device, kv_cache=kv_cache, seq_lens=seq_lens, block_table=block_table)
    check_runnable(device)
    check_launchable(_decode_split_kernel, device)
    out = check_attention_out(out, q)
    if num_reqs == 0:
        return out

    capacity = block_table.shape[1] * block_size
    max_seq_len = capacity if max_seq_len is None else min(int(max_seq_len), capacity)
    check(max_seq_len >= 1, "max_seq_len must be >= 1")
    window = window_constexpr(sliding_window)
    span = min(max_seq_len, window) if window else max_seq_len  # keys one sequence reads at most
    if num_splits is None:
        num_splits = choose_num_splits(span, num_reqs, num_kv_heads, device)
    check(isinstance(num_splits, int) and 1 <= num_splits <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}]")

    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))
    interp = triton_interpret_enabled()
    num_warps = 1 if interp else 4
    block_n = 16 if interp else kv_tile_size(block_d, num_warps)
    tokens_per_split = triton.cdiv(triton.cdiv(span, num_splits), block_n) * block_n
    num_splits = triton.cdiv(span, tokens_per_split)  # drop splits left empty by rounding

    part_out = torch.empty(num_reqs, num_heads, num_splits, block_d, dtype=torch.float32, device=device)
    part_lse = torch.empty(num_reqs, num_heads, num_splits, dtype=torch.float32, device=device)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q, kv_cache, seq_lens, block_table, part_out, part_lse,
        float(scale) * LOG2E, tokens_per_split,
        q.stride(0), q.stride(1),
        value_stride(kv_cache), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size,
        GROUP=group, BLOCK_H=max(16, next_pow2(group)), BLOCK_N=block_n,
        num_warps=num_warps, num_stages=1 if interp else 2,
        OFFSETS_I64=offsets_i64(kv_cache),
        QUANTIZED=is_quantized(kv_cache.dtype),
        WINDOW=window,
        **dot_flags(q.dtype),
    )
    _decode_reduce_kernel[(num_reqs, num_heads)](
        part_out, part_lse, out, seq_lens, tokens_per_split,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits),
        WINDOW=window, num_warps=1 if interp else 4,
    )
    return out


def paged_decode_attention_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Reference for ``paged_decode_attention``: the varlen reference with query_len = 1."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return varlen_paged_attention_reference(q, kv_cache, query_start_loc, seq_lens, block_table, scale,
                                            sliding_window=sliding_window)
