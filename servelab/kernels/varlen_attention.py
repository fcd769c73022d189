"""Triton kernel: FlashAttention-2 style causal attention over a flat batch and a paged KV cache.

One program handles one request, one KV head and a tile of that request's new
tokens; the rows of the tile are (query token, query head of the KV head's
group) pairs, so GQA heads share every K/V tile they load.  The program walks
the context in BLOCK_N-token key tiles read through the block table, keeps an
online softmax in float32 (base-2 exponentials) and stops at the tile's causal
limit, so the N x N score matrix never exists.  With a sliding window it starts
at the window of the tile's first query: keys before it are never loaded (their
block-table entries may name a placeholder block).  With a token tree mask, the keys
of a request's tree (its last ``tree_lens[r]`` positions) are read by a row only where
its mask row allows (its ancestors and itself).
"""

from __future__ import annotations

import math
import numbers

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

__all__ = ["varlen_paged_attention", "varlen_paged_attention_reference"]

LOG2E = math.log2(math.e)


@triton.jit
def _varlen_paged_attention_kernel(
    q_ptr, kv_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_table_ptr,
    tree_mask_ptr, tree_lens_ptr, stride_tm,     # tree_mask [T, W] uint8, tree_lens [R] (TREE only)
    qk_scale_log2,                               # softmax scale * log2(e)
    stride_qt, stride_qh,                        # q [T, H, D]
    stride_c0, stride_cb, stride_cs, stride_ch,  # kv_cache [2, blocks, block_size, Hkv, D]
    stride_ot, stride_oh,                        # out [T, H, D]
    stride_bt,                                   # block_table [R, max_blocks]
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,       # next power of two >= HEAD_DIM (>= 16)
    BLOCK_SIZE: tl.constexpr,    # KV-cache block size
    GROUP: tl.constexpr,         # query heads per KV head
    GROUP_PAD: tl.constexpr,     # next power of two >= GROUP
    BLOCK_M: tl.constexpr,       # rows per program = query tokens per tile * GROUP_PAD
    BLOCK_N: tl.constexpr,       # keys per inner-loop tile
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,    # see _triton_utils.mma
    OFFSETS_I64: tl.constexpr,   # int64 cache offsets (huge caches)
    QUANTIZED: tl.constexpr,     # int8 / float8 cache rows: D values, then a float32 scale
    WINDOW: tl.constexpr,        # sliding window (keys pos - WINDOW < k <= pos); 0: full attention
    TREE: tl.constexpr,          # token trees: mask the keys of each request's tree per row
):
    """Grid (query tiles, requests, KV heads); see the module docstring."""
    q_tile = tl.program_id(0)
    req = tl.program_id(1)
    kv_head = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    first_pos = seq_len - q_len  # context position of the request's first new token

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP_PAD
    head_in_group = offs_m % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_valid = (q_idx < q_len) & (head_in_group < GROUP)
    q_pos = first_pos + q_idx
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM

    q_rows = (q_start + q_idx).to(tl.int64)
    io_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)

    # Finite initial max keeps padding rows (no valid key) free of NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys this tile may see: from the window start of its first row to the causal limit of its last.
    lo = window_start(first_pos + q_tile * BLOCK_Q, WINDOW)
    hi = first_pos + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    if TREE:
        tree_begin = seq_len - tl.load(tree_lens_ptr + req)
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
        keep = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if WINDOW > 0:
            keep = keep & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        if TREE:
            column = k_pos - tree_begin
            reads = tl.load(tree_mask_ptr + q_rows[:, None] * stride_tm + column[None, :],
                            mask=keep & row_valid[:, None] & (column[None, :] >= 0), other=1)
            keep = keep & (reads != 0)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANTIZED:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def _launch_config(max_query_len: int, group_pad: int, block_d: int) -> dict:
    """Tile sizes: BLOCK_M covers (query tokens x group heads); BLOCK_N keeps registers in check."""
    if triton_interpret_enabled():  # tiny tiles in the interpreter: exercise the loops
        return dict(BLOCK_M=max(16, min(32, next_pow2(max_query_len) * group_pad), group_pad),
                    BLOCK_N=16, num_warps=1, num_stages=1)
    cap = 128 if block_d <= 128 else 64
    block_m = max(16, min(cap, next_pow2(max_query_len) * group_pad), group_pad)
    num_warps = 8 if block_m >= 128 or block_d >= 256 else 4
    return dict(BLOCK_M=block_m, BLOCK_N=kv_tile_size(block_d, num_warps),
                num_warps=num_warps, num_stages=2)


def varlen_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,
    tree_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flat batch's new tokens over their paged context; returns [T, H, D].

    q: [T, H, D]; kv_cache: [2, num_blocks, block_size, Hkv, D] (new tokens already
    written); query_start_loc: int32 [R+1]; seq_lens: int32 [R] (context incl. new
    tokens); block_table: int32 [R, max_blocks]; max_query_len: host-side max (or upper
    bound) of the query lengths (no GPU sync); out: optional [T, H, D] output buffer;
    sliding_window: W lets position p see keys p - W < k <= p (None: full causal).
    Query row i of request r sits at position seq_lens[r] - query_len_r + i; keys before
    the window of a request's first query are not read.
    tree_mask: bool [T, W] and tree_lens: int32 [R] (together, or neither): the last
    tree_lens[r] keys of request r are a token tree; row t reads its key j only where
    tree_mask[t, j] (``core/attention.py``'s ``TreeMask``).
    Values are not checked (that needs a GPU sync): query_len_r <= seq_lens[r] and
    the block table must cover each context.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    check(q.dim() == 3, f"q must be [T, H, D], got {tuple(q.shape)}")
    num_tokens, num_heads, q_head_dim = q.shape
    check(q_head_dim == head_dim, f"q head_dim {q_head_dim} != kv_cache head_dim {head_dim}")
    check(num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    check(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype} must be one of {FLOAT_DTYPES}")
    check_cache_dtype(kv_cache, q.dtype, "q")
    check(q.stride(-1) == 1, "q must be contiguous in head_dim")
    check(query_start_loc.dim() == 1 and query_start_loc.shape[0] >= 1, "query_start_loc must be [R+1]")
    num_reqs = query_start_loc.shape[0] - 1
    check_index_tensor(query_start_loc, "query_start_loc", (num_reqs + 1,), torch.int32)
    check_index_tensor(seq_lens, "seq_lens", (num_reqs,), torch.int32)
    check_block_table(block_table, num_reqs)
    check(isinstance(max_query_len, numbers.Integral) and max_query_len >= 0, "max_query_len must be a non-negative int")
    window = window_constexpr(sliding_window)
    check((tree_mask is None) == (tree_lens is None), "tree_mask and tree_lens go together")
    if tree_mask is not None:
        check(tree_mask.dtype == torch.bool and tree_mask.dim() == 2 and tree_mask.shape[0] == num_tokens
              and tree_mask.stride(1) == 1, f"tree_mask must be bool [T, W] with unit last stride, got "
              f"{tree_mask.dtype} {tuple(tree_mask.shape)}")
        check_index_tensor(tree_lens, "tree_lens", (num_reqs,), torch.int32)
    device = q.device
    check_same_device(device, kv_cache=kv_cache, query_start_loc=query_start_loc,
                      seq_lens=seq_lens, block_table=block_table)
    check_runnable(device)
    check_launchable(_varlen_paged_attention_kernel, device)
    out = check_attention_out(out, q)
    if num_tokens == 0 or num_reqs == 0 or max_query_len == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_d = max(16, next_pow2(head_dim))
    cfg = _launch_config(max_query_len, group_pad, block_d)
    block_q = cfg["BLOCK_M"] // group_pad
    grid = (triton.cdiv(max_query_len, block_q), num_reqs, num_kv_heads)
    tree = tree_mask is not None
    _varlen_paged_attention_kernel[grid](
        q, kv_cache, out, query_start_loc, seq_lens, block_table,
        tree_mask.view(torch.uint8) if tree else seq_lens, tree_lens if tree else seq_lens,
        tree_mask.stride(0) if tree else 0,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1),
        value_stride(kv_cache), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        out.stride(0), out.stride(1),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=group_pad,
        OFFSETS_I64=offsets_i64(kv_cache),
        QUANTIZED=is_quantized(kv_cache.dtype),
        WINDOW=window,
        TREE=tree,
        **dot_flags(q.dtype),
        **cfg,
    )
    return out
