"""Soft-capped attention scores (``AttentionSpec.softcap``): ``cap * tanh(scores / cap)``
on the scaled scores before masking, and the explicit-scores attention that backends whose
fused kernels cannot cap take instead."""

from __future__ import annotations

import torch


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``scores`` squashed into (-softcap, softcap), or unchanged when ``softcap`` is None."""
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


def softcapped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                         is_causal: bool, scale: float, softcap: float) -> torch.Tensor:
    """``scaled_dot_product_attention``'s contract with capped scores: query [..., H, L, D],
    key and value [..., Hkv, S, D] (H a multiple of Hkv); ``attn_mask`` bool, broadcast to
    [..., H, L, S] (True = may attend), or ``is_causal`` (query row i sees keys 0 to i).
    Scores and softmax in float32; returns [..., H, L, D] in the query's dtype."""
    group = query.shape[-3] // key.shape[-3]
    keys = key.float().repeat_interleave(group, dim=-3)
    values = value.float().repeat_interleave(group, dim=-3)
    scores = capped(query.float() @ keys.transpose(-1, -2) * scale, softcap)
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return (scores.softmax(dim=-1) @ values).to(query.dtype)
