"""Torch operations on the ``[2, num_blocks, block_size, Hkv, D]`` cache layout."""

from __future__ import annotations

import torch


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value rows [T, Hkv, D] at their slots [T] (int64)."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def context_slots(block_row: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Slots [length] of the first ``length`` positions of a sequence with block ids ``block_row``."""
    positions = torch.arange(length, device=block_row.device)
    return block_row[positions // block_size].long() * block_size + positions % block_size


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at ``slots`` (any shape S) -> two tensors [*S, Hkv, D]."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    return flat[0][slots], flat[1][slots]


def attention_mask(query_len: int, seq_len: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """Boolean [query_len, seq_len], True where a new token may attend (causal, optional window)."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    return allowed


def reads_only_new_tokens(query_len: int, seq_len: int, sliding_window: int | None) -> bool:
    """True when a request's attention is plain causal attention over its new tokens: no
    cached context and no window shorter than the sequence (a fresh prefill)."""
    return seq_len == query_len and (sliding_window is None or sliding_window >= seq_len)
