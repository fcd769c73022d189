"""Attention through ``torch.nn.functional.scaled_dot_product_attention`` over the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelab.core.attention import AttentionBackend, BatchLayout
from servelab.core.component import ComponentSpec
from servelab.kernels.kv_quantization import round_trip
from servelab.plugins.attention.cache_ops import dequantized, reads_only_new_tokens, tree_attention_mask, write_kv
from servelab.plugins.attention.softcap import softcapped_attention


@dataclass
class SdpaAttentionConfig:
    """``attention=sdpa``: no options."""


@dataclass(frozen=True, slots=True)
class PrefillPart:
    """A request with several new tokens: query rows ``start:start+query_len``; ``blocks``
    [n] of its context, or None when the context is exactly the new tokens; ``mask``
    [query_len, n * block_size] bool, or None for plain causal attention."""

    start: int
    query_len: int
    blocks: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """Single-token requests of similar context length, run as one padded SDPA call:
    query ``rows`` [Rb], context ``blocks`` [Rb, n] and ``mask`` [Rb, 1, 1, n * block_size]."""

    rows: torch.Tensor
    blocks: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True, slots=True)
class SdpaMetadata:
    """Gather indices built once per step and shared by every layer: the decode
    ``buckets`` and the ``prefills`` (requests with several new tokens)."""

    layout: BatchLayout
    buckets: tuple[DecodeBucket, ...]
    prefills: tuple[PrefillPart, ...]


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
           scale: float, gqa: bool, softcap: float | None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` over [B, H, L, D] queries and [B, Hkv, S, D] keys and
    values, or, with a ``softcap``, the explicit-scores path (no fused kernel caps scores)."""
    if softcap is not None:
        return softcapped_attention(query, key, value, mask, is_causal, scale, softcap)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=gqa)


def sdpa_one_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool,
                     mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of one request's query rows q [n, H, D] over keys/values [m, Hkv, D]:
    causal when ``mask`` is None, else ``mask`` [n, m] (True = may attend); scores capped at
    ``softcap`` when set. Returns [n, H, D]."""
    # 4-D inputs take torch's fused CPU kernel; 3-D ones fall back to the math path
    result = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, mask is None,
                    scale, gqa, softcap)
    return result[0].transpose(0, 1)


MAX_DECODE_BUCKETS = 4
MIN_BUCKET_REQUESTS = 16
"""Decodes are sorted by context length and split into up to 4 buckets of >= 16
requests, so a padded batch gathers little more than its real contexts."""


class SdpaAttention(AttentionBackend):
    """Batches single-token requests into a few padded SDPA calls (by context length)
    and runs the others one by one, with an explicit mask where they have cached context
    or a token tree (plain causal SDPA when nothing is cached yet); with
    ``spec.softcap`` every call takes the explicit-scores path, which caps the scores.

    Contexts are gathered block by block into a persistent workspace: a fresh buffer per
    layer and step would cost more in page faults than the copy itself. A quantized cache
    is gathered and dequantized to the model's dtype; a fresh prefill then attends over
    its keys and values rounded as the cache stores them, like every later step.
    """

    reads_quantized_kv = True
    reads_token_trees = True
    reads_values_from_keys = True

    def __init__(self, config, spec):
        super().__init__(config, spec)
        self._workspace: tuple[torch.Tensor, ...] | None = None

    def build_metadata(self, layout: BatchLayout) -> SdpaMetadata:
        """Precompute the padded decode block lists, masks and per-prefill blocks."""
        device = layout.slot_mapping.device
        window = self.spec.sliding_window
        size = layout.block_size
        starts = [0]
        for query_len in layout.query_lens:
            starts.append(starts[-1] + query_len)
        tree_lens = layout.tree.lens if layout.tree is not None else (0,) * len(layout.query_lens)
        decode = [r for r, n in enumerate(layout.query_lens) if n == 1 and tree_lens[r] <= 1]
        prefills = []
        for r, (query_len, seq_len) in enumerate(zip(layout.query_lens, layout.seq_lens_list)):
            if query_len == 1 and tree_lens[r] <= 1:
                continue
            fresh = reads_only_new_tokens(query_len, seq_len, window) and not tree_lens[r]
            num_blocks = -(-seq_len // size)
            blocks = None if fresh else layout.block_table[r, :num_blocks].long()
            mask = None
            if not fresh:
                mask = torch.zeros(query_len, num_blocks * size, dtype=torch.bool, device=device)
                mask[:, :seq_len] = tree_attention_mask(layout, r, starts[r], window)
            prefills.append(PrefillPart(starts[r], query_len, blocks, mask))
        decode.sort(key=lambda r: layout.seq_lens_list[r])
        count = max(1, min(MAX_DECODE_BUCKETS, len(decode) // MIN_BUCKET_REQUESTS))
        bounds = [len(decode) * i // count for i in range(count + 1)]
        buckets = tuple(self._bucket(layout, decode[a:b], starts) for a, b in zip(bounds, bounds[1:]) if b > a)
        return SdpaMetadata(layout, buckets, tuple(prefills))

    def _bucket(self, layout: BatchLayout, requests: list[int], starts: list[int]) -> DecodeBucket:
        device = layout.slot_mapping.device
        size = layout.block_size
        index = torch.tensor(requests, device=device)
        seq_lens = layout.seq_lens[index].long()
        num_blocks = -(-layout.seq_lens_list[requests[-1]] // size)
        positions = torch.arange(num_blocks * size, device=device)
        valid = positions[None, :] < seq_lens[:, None]
        if self.spec.sliding_window is not None:
            valid &= positions[None, :] >= seq_lens[:, None] - self.spec.sliding_window
        rows = torch.tensor([starts[r] for r in requests], device=device)
        return DecodeBucket(rows, layout.block_table[index, :num_blocks].long(), valid[:, None, None, :])

    def _gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``blocks`` (any shape S) -> two tensors [*S * block_size, Hkv, D]:
        views into the workspace (valid until the next call), or dequantized copies; the
        same tensor twice when values are keys."""
        parts = kv_cache.shape[0]
        tokens = (*blocks.shape[:-1], blocks.shape[-1] * kv_cache.shape[2], *kv_cache.shape[3:])
        flat = blocks.reshape(-1)
        if self.spec.kv_quantized:
            raw = kv_cache.view(torch.uint8)
            gathered = tuple(dequantized(raw[i].index_select(0, flat).view(kv_cache.dtype).view(tokens),
                                         self.spec.dtype) for i in range(parts))
            return gathered[0], gathered[-1]
        count = blocks.numel()
        if self._workspace is None or self._workspace[0].shape[0] < count or len(self._workspace) != parts or \
                self._workspace[0].dtype != kv_cache.dtype or self._workspace[0].device != kv_cache.device:
            capacity = max(count, 2 * self._workspace[0].shape[0] if self._workspace else 0)
            shape = (capacity, *kv_cache.shape[2:])
            self._workspace = tuple(torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
                                    for _ in range(parts))
        gathered = tuple(torch.index_select(kv_cache[i], 0, flat, out=self._workspace[i][:count]).view(tokens)
                         for i in range(parts))
        return gathered[0], gathered[-1]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: SdpaMetadata, layer_index: int) -> torch.Tensor:
        """See ``AttentionBackend.forward``."""
        write_kv(kv_cache, k, v, meta.layout.slot_mapping)
        out = torch.empty_like(q)
        scale, softcap = self.spec.scale, self.spec.softcap
        gqa = self.spec.num_heads != self.spec.num_kv_heads
        for part in meta.prefills:
            rows = slice(part.start, part.start + part.query_len)
            if part.blocks is None and self.spec.kv_quantized:  # the values the cache holds
                keys, values = round_trip(k[rows], self.spec.kv_dtype), round_trip(v[rows], self.spec.kv_dtype)
            elif part.blocks is None:
                keys, values = k[rows], v[rows]
            else:
                keys, values = self._gather(kv_cache, part.blocks)
            out[rows] = sdpa_one_request(q[rows], keys, values, scale, gqa, part.mask, softcap)
        for bucket in meta.buckets:
            keys, values = self._gather(kv_cache, bucket.blocks)
            out[bucket.rows] = attend(q[bucket.rows][:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                                      bucket.mask, False, scale, gqa, softcap)[:, :, 0, :]
        return out


SPEC = ComponentSpec("attention", "sdpa", SdpaAttention, SdpaAttentionConfig,
                     "torch scaled_dot_product_attention over the cache (fast CPU path)")
