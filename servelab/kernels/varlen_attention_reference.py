"""Pure-torch reference for causal attention over a flat batch and a paged KV cache.

Slow and simple on purpose (a loop over requests, the context gathered
through the block table, an explicit causal and window mask, GQA by
repeat_interleave);
the Triton kernels in ``varlen_attention`` and ``decode_attention`` are tested
against it.
"""

from __future__ import annotations

import torch

from servelab.core.kv_cache_dtype import is_quantized
from servelab.kernels.kv_quantization import dequantize_kv


def gather_context(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one request's keys and values of positions ``start .. seq_len``
    ``[seq_len - start, Hkv, D]`` in position order (dequantized to float32 from an int8 /
    float8_e4m3fn cache; the keys twice from a cache of keys alone); blocks wholly before
    ``start`` are not read."""
    block_size, num_kv_heads, row = kv_cache.shape[2:]
    num_blocks = -(-seq_len // block_size)
    if num_blocks > block_table_row.shape[0]:
        raise ValueError(f"seq_len {seq_len} needs {num_blocks} blocks, table has {block_table_row.shape[0]}")
    first = start // block_size
    blocks = block_table_row[first:num_blocks].long()
    span = slice(start - first * block_size, seq_len - first * block_size)
    quantized = is_quantized(kv_cache.dtype)
    raw = kv_cache.view(torch.uint8) if quantized else kv_cache
    k = raw[0, blocks].reshape(-1, num_kv_heads, row)[span].view(kv_cache.dtype)
    v = raw[-1, blocks].reshape(-1, num_kv_heads, row)[span].view(kv_cache.dtype)
    if quantized:
        return dequantize_kv(k, torch.float32), dequantize_kv(v, torch.float32)
    return k, v


def varlen_paged_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    tree_mask: torch.Tensor | None = None,
    tree_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for ``varlen_paged_attention`` (same arguments; max_query_len is unused).

    Request r owns q rows ``query_start_loc[r]:query_start_loc[r+1]``; they are the
    last positions of its ``seq_lens[r]``-token context and attend causally to it
    (position p to keys p - sliding_window < k <= p with a window; keys before the
    first row's window are not read); the last ``tree_lens[r]`` keys are read by a row
    only where its ``tree_mask`` row allows. Computes in float32 and casts to q's dtype.
    """
    num_heads = q.shape[1]
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        q_lo, q_hi = starts[r], starts[r + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"request {r}: query_len {q_len} > seq_len {seq_len}")
        start = 0 if sliding_window is None else max(seq_len - q_len - sliding_window + 1, 0)
        k, v = gather_context(kv_cache, block_table[r], seq_len, start)
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_lo:q_hi].float(), k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(start, seq_len, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
        size = int(tree_lens[r]) if tree_lens is not None else 0
        if size:
            allowed[:, allowed.shape[1] - size:] &= tree_mask[q_lo:q_hi, :size]
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
