"""Torch operations on the ``[2, num_blocks, block_size, Hkv, D]`` cache layout (keys, then
values; ``[1, ...]``, keys alone, when values are keys: ``AttentionSpec.values_are_keys``;
rows of ``D + 4`` bytes, values then scale, when quantized:
``servelab/kernels/kv_quantization.py``)."""

from __future__ import annotations

import torch

from servelab.core.kv_cache_dtype import is_quantized
from servelab.kernels.kv_quantization import dequantize_kv, quantize_kv


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value rows [T, Hkv, D] at their slots [T] (int64), quantized when the cache
    is; a cache of keys alone stores ``key``."""
    parts = kv_cache.shape[0]
    if is_quantized(kv_cache.dtype):
        key = quantize_kv(key, kv_cache.dtype).view(torch.uint8)
        value = quantize_kv(value, kv_cache.dtype).view(torch.uint8) if parts == 2 else None
        kv_cache = kv_cache.view(torch.uint8)
    flat = kv_cache.view(parts, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, key)
    if parts == 2:
        flat[1].index_copy_(0, slot_mapping, value)


def dequantized(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., Hkv, D] in ``dtype``: dequantized when the cache is quantized."""
    return dequantize_kv(rows, dtype) if is_quantized(rows.dtype) else rows.to(dtype)


def context_slots(block_row: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Slots [length] of the first ``length`` positions of a sequence with block ids ``block_row``."""
    positions = torch.arange(length, device=block_row.device)
    return block_row[positions // block_size].long() * block_size + positions % block_size


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at ``slots`` (any shape S) -> two tensors [*S, Hkv, D] in ``dtype``
    (the same tensor twice when values are keys)."""
    raw = kv_cache.view(torch.uint8) if is_quantized(kv_cache.dtype) else kv_cache
    flat = raw.view(kv_cache.shape[0], -1, kv_cache.shape[-2], kv_cache.shape[-1])
    keys = dequantized(flat[0][slots].view(kv_cache.dtype), dtype)
    if kv_cache.shape[0] == 1:
        return keys, keys
    return keys, dequantized(flat[1][slots].view(kv_cache.dtype), dtype)


def attention_mask(query_len: int, seq_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [query_len, seq_len], True where a new token may attend (causal, optional window)."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    return allowed


def tree_attention_mask(layout, request: int, first_row: int, window: int | None) -> torch.Tensor:
    """Boolean [query_len, seq_len] for request ``request`` of ``layout`` whose rows start at
    ``first_row``: causal (optional window), with the keys of its token tree
    (``layout.tree``) read only by their descendants."""
    query_len, seq_len = layout.query_lens[request], layout.seq_lens_list[request]
    allowed = attention_mask(query_len, seq_len, window, layout.slot_mapping.device)
    size = layout.tree.lens[request] if layout.tree is not None else 0
    if size:
        allowed[:, seq_len - size:] = layout.tree.mask[first_row:first_row + query_len, :size]
    return allowed


def reads_only_new_tokens(query_len: int, seq_len: int, sliding_window: int | None) -> bool:
    """True when a request's attention is plain causal attention over its new tokens: no
    cached context and no window shorter than the sequence (a fresh prefill)."""
    return seq_len == query_len and (sliding_window is None or sliding_window >= seq_len)
