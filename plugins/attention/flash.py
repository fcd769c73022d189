"""``attention=flash``: servelab's Triton kernels (FlashAttention-2 varlen, flash-decoding)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from servelab.core.attention import AttentionBackend, AttentionSpec, BatchLayout
from servelab.core.component import ComponentSpec

FP8_MIN_CAPABILITY = (8, 9)
"""CUDA devices from Ada / Hopper on convert to and from float8 in hardware."""


@dataclass
class FlashAttentionConfig:
    """``decode_kernel``: use the split-context decode kernel when every request has one
    new token (false = the varlen kernel for every step)."""

    decode_kernel: bool = True


class FlashAttention(AttentionBackend):
    """Writes k/v with the cache-write kernel, then runs the varlen kernel over the block
    table (masking token trees), or the flash-decoding kernel for pure-decode steps without
    trees. Runs on CUDA, or on CPU
    inside Triton's interpreter when ``TRITON_INTERPRET=1``. Quantized caches (int8,
    float8_e4m3) are written quantized and their scales applied inside the kernels."""

    reads_quantized_kv = True
    reads_token_trees = True
    reads_values_from_keys = True

    def __init__(self, config: FlashAttentionConfig, spec: AttentionSpec):
        super().__init__(config, spec)
        from servelab.kernels.cache_write import write_kv_cache
        from servelab.kernels.decode_attention import paged_decode_attention
        from servelab.kernels.varlen_attention import varlen_paged_attention

        self._write = write_kv_cache
        self._decode = paged_decode_attention
        self._varlen = varlen_paged_attention

    @classmethod
    def unsupported_reasons(cls, config: Any, spec: AttentionSpec) -> list[str]:
        """Needs triton with CUDA (or the interpreter)."""
        from servelab.kernels.availability import triton_unavailable_reason

        reasons = []
        unavailable = triton_unavailable_reason()
        if unavailable:
            reasons.append(unavailable)
        if spec.softcap is not None:
            reasons.append(f"soft-capped attention scores (softcap {spec.softcap}) are not supported by the Triton "
                           "kernels; use attention=sdpa or attention=naive")
        if (spec.kv_dtype == getattr(torch, "float8_e4m3fn", None) and spec.device.type == "cuda"
                and torch.cuda.get_device_capability(spec.device) < FP8_MIN_CAPABILITY):
            reasons.append("cache.kv_dtype=fp8_e4m3 needs a GPU of compute capability 8.9 or newer for Triton's "
                           "float8 conversions; use cache.kv_dtype=int8")
        return reasons

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: BatchLayout, layer_index: int) -> torch.Tensor:
        """See ``AttentionBackend.forward``."""
        self._write(k, v, kv_cache, meta.slot_mapping)
        tree = meta.tree
        if meta.is_pure_decode and self.config.decode_kernel and tree is None:
            return self._decode(q, kv_cache, meta.seq_lens, meta.block_table, self.spec.scale,
                                max_seq_len=meta.max_seq_len, sliding_window=self.spec.sliding_window)
        return self._varlen(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, self.spec.scale,
                            meta.max_query_len, sliding_window=self.spec.sliding_window,
                            tree_mask=None if tree is None else tree.mask,
                            tree_lens=None if tree is None else tree.lens_tensor)


SPEC = ComponentSpec("attention", "flash", FlashAttention, FlashAttentionConfig,
                     "Triton FlashAttention-2 varlen + flash-decoding kernels over the block table")
