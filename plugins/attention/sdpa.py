"""Attention through ``torch.nn.functional.scaled_dot_product_attention`` over the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelab.core.attention import AttentionBackend, BatchLayout
from servelab.core.component import ComponentSpec
from servelab.plugins.attention.cache_ops import attention_mask, context_slots, gather_kv, write_kv


@dataclass
class SdpaAttentionConfig:
    """``attention=sdpa``: no options."""


@dataclass(frozen=True, slots=True)
class PrefillPart:
    """A request with several new tokens: query rows ``start:start+query_len``; ``slots``
    [seq_len] of its context, or None when the context is exactly the new tokens;
    ``mask`` [query_len, seq_len] bool, or None for plain causal attention."""

    start: int
    query_len: int
    slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class SdpaMetadata:
    """Gather indices built once per step and shared by every layer.

    ``decode_rows`` [Rd]: query rows with one new token (None: all rows are decodes).
    ``decode_slots`` [Rd, Lmax] and ``decode_mask`` [Rd, 1, 1, Lmax]: their padded
    contexts. ``prefills``: the other requests.
    """

    layout: BatchLayout
    decode_rows: torch.Tensor | None
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: tuple[PrefillPart, ...]


class SdpaAttention(AttentionBackend):
    """Batches every single-token request into one padded SDPA call and runs the others
    one by one (plain causal SDPA when nothing is cached yet)."""

    def build_metadata(self, layout: BatchLayout) -> SdpaMetadata:
        """Precompute the padded decode gather and per-prefill slots and masks."""
        device = layout.slot_mapping.device
        window = self.spec.sliding_window
        starts = [0]
        for query_len in layout.query_lens:
            starts.append(starts[-1] + query_len)
        decode = [r for r, n in enumerate(layout.query_lens) if n == 1]
        prefills = []
        for r, (query_len, seq_len) in enumerate(zip(layout.query_lens, layout.seq_lens_list)):
            if query_len == 1:
                continue
            fresh = seq_len == query_len and (window is None or window >= seq_len)
            slots = None if fresh else context_slots(layout.block_table[r], layout.block_size, seq_len)
            mask = None if fresh else attention_mask(query_len, seq_len, window, device)
            prefills.append(PrefillPart(starts[r], query_len, slots, mask))
        decode_rows = decode_slots = decode_mask = None
        if decode:
            rows = torch.tensor(decode, device=device)
            seq_lens = layout.seq_lens[rows].long()
            max_len = max(layout.seq_lens_list[r] for r in decode)
            positions = torch.arange(max_len, device=device)
            blocks = layout.block_table[rows][:, positions // layout.block_size].long()
            decode_slots = blocks * layout.block_size + positions % layout.block_size
            valid = positions[None, :] < seq_lens[:, None]
            if window is not None:
                valid &= positions[None, :] >= seq_lens[:, None] - window
            decode_mask = valid[:, None, None, :]
            if len(decode) < len(layout.query_lens):
                decode_rows = torch.tensor([starts[r] for r in decode], device=device)
        return SdpaMetadata(layout, decode_rows, decode_slots, decode_mask, tuple(prefills))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: SdpaMetadata, layer_index: int) -> torch.Tensor:
        """See ``AttentionBackend.forward``."""
        write_kv(kv_cache, k, v, meta.layout.slot_mapping)
        out = torch.empty_like(q)
        scale = self.spec.scale
        gqa = self.spec.num_heads != self.spec.num_kv_heads
        for part in meta.prefills:
            rows = slice(part.start, part.start + part.query_len)
            if part.slots is None:
                keys, values = k[rows], v[rows]
            else:
                keys, values = gather_kv(kv_cache, part.slots)
            # 4-D inputs take torch's fused CPU kernel; 3-D ones fall back to the math path
            result = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=part.mask, is_causal=part.mask is None, scale=scale, enable_gqa=gqa)
            out[rows] = result[0].transpose(0, 1)
        if meta.decode_slots is not None:
            query = q if meta.decode_rows is None else q[meta.decode_rows]
            keys, values = gather_kv(kv_cache, meta.decode_slots)
            result = F.scaled_dot_product_attention(
                query[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa)[:, :, 0, :]
            if meta.decode_rows is None:
                out = result
            else:
                out[meta.decode_rows] = result
        return out


SPEC = ComponentSpec("attention", "sdpa", SdpaAttention, SdpaAttentionConfig,
                     "torch scaled_dot_product_attention over the cache (fast CPU path)")
