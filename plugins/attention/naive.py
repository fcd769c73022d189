"""The reference attention: explicit scores and softmax per request, in float32."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelab.core.attention import AttentionBackend, BatchLayout
from servelab.core.component import ComponentSpec
from servelab.plugins.attention.cache_ops import context_slots, gather_kv, tree_attention_mask, write_kv
from servelab.plugins.attention.softcap import capped


@dataclass
class NaiveAttentionConfig:
    """``attention=naive``: no options."""


class NaiveAttention(AttentionBackend):
    """Loops over requests, gathers each context through its block table (dequantized to
    float32 from a quantized cache), and computes softmax(q k^T * scale) v with the causal
    mask (token trees: each node reads its ancestors only; the scaled scores soft-capped first when ``spec.softcap`` is set); grouped-query
    heads are repeated."""

    reads_quantized_kv = True
    reads_token_trees = True
    reads_values_from_keys = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: BatchLayout, layer_index: int) -> torch.Tensor:
        """See ``AttentionBackend.forward``."""
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        group = self.spec.num_heads // self.spec.num_kv_heads
        start = 0
        for r, (query_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens_list)):
            slots = context_slots(meta.block_table[r], meta.block_size, seq_len)
            keys, values = gather_kv(kv_cache, slots, torch.float32)
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            query = q[start:start + query_len].float()
            scores = capped(torch.einsum("qhd,khd->hqk", query, keys) * self.spec.scale, self.spec.softcap)
            allowed = tree_attention_mask(meta, r, start, self.spec.sliding_window)
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
            out[start:start + query_len] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
            start += query_len
        return out


SPEC = ComponentSpec("attention", "naive", NaiveAttention, NaiveAttentionConfig,
                     "pure-PyTorch reference: per-request softmax attention over the cache")
