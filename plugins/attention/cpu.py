"""Native CPU paged attention: a C++ kernel that reads the paged cache in place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelab.core.attention import AttentionBackend, AttentionSpec, BatchLayout
from servelab.core.component import ComponentSpec
from servelab.core.kv_cache_dtype import SCALE_BYTES
from servelab.kernels.cpu_ops import native_cpu_ops, native_cpu_unavailable_reason
from servelab.kernels.kv_quantization import round_trip
from servelab.plugins.attention.cache_ops import reads_only_new_tokens


@dataclass
class CpuAttentionConfig:
    """``attention=cpu``: no options."""


@dataclass(frozen=True, slots=True)
class CpuMetadata:
    """Per-step split of the batch: the query rows ``fresh_starts[i]`` to ``fresh_starts[i]
    + fresh_lengths[i]`` of requests whose context is exactly their new tokens (causal
    SDPA over their own k/v, no cache read), and ``cached`` [n] int32 indices of the other
    requests (decodes, chunked prefills, prefix-cache hits, speculative verification),
    which the paged kernel serves (masking the layout's token trees)."""

    layout: BatchLayout
    fresh_starts: tuple[int, ...]
    fresh_lengths: tuple[int, ...]
    cached: torch.Tensor


class CpuAttention(AttentionBackend):
    """Requests with cached context go through ``servelab_cpu.paged_attention``: one pass
    over each context straight from the block table in its own tiled cache layout
    (``kv_cache_shape``), grouped-query heads sharing every key/value load, online softmax
    in float32, threads over (request, KV head, query tile), token trees masked. Fresh prefills attend over
    their new keys and values only (``servelab_cpu.causal_prefill_attention``): on the AMX
    tile unit in bfloat16, otherwise torch's fused SDPA, short prompts side by side on the
    threads. A quantized cache (``cache.kv_dtype`` int8 / fp8_e4m3) is written quantized
    and read with its scales applied to the scores and the softmax weights; fresh prefills
    then attend over their keys and values rounded as the cache stores them.
    """

    kv_cache_block_axis = 0  # the tiled layout puts blocks first (kv_cache_shape)
    reads_quantized_kv = True
    reads_token_trees = True
    reads_values_from_keys = True

    @classmethod
    def unsupported_reasons(cls, config, spec: AttentionSpec) -> list[str]:
        """Needs CPU tensors, the native ops built for this machine, and scores without a
        soft cap (the kernels do not cap them)."""
        reasons = []
        if spec.softcap is not None:
            reasons.append(f"attention=cpu does not soft-cap attention scores (softcap {spec.softcap}); "
                           "use attention=sdpa or attention=naive")
        if spec.device.type != "cpu":
            reasons.append(f"attention=cpu runs on CPU tensors, not {spec.device.type}; use attention=flash or sdpa")
        reason = native_cpu_unavailable_reason()
        if reason is not None:
            reasons.append(f"attention=cpu needs the native CPU ops: {reason}")
        elif not native_cpu_ops().supports_head_dim(spec.head_dim):
            reasons.append(f"attention=cpu does not support head_dim {spec.head_dim} on this CPU "
                           "(multiples of the SIMD width up to 6 vectors, or 8 or 16 vectors); use attention=sdpa")
        return reasons

    def __init__(self, config, spec):
        super().__init__(config, spec)
        self._ops = native_cpu_ops()
        self._kv_quantized = spec.kv_quantized

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``[num_blocks, Hkv, 2, block_size * D]``: per (block, KV head) a tile of keys
        transposed ([D][block_size], so scores of consecutive positions are SIMD lanes)
        followed by a tile of values row-major ([block_size][D]). A block's keys and values
        for all its heads are one contiguous stretch of memory, which the work items of a
        request read one after another: decode attention over scattered blocks is 6-9%
        faster than with keys and values in separate halves of the tensor.
        A quantized cache (int8 / float8_e4m3fn) follows each tile by its block_size float32
        scales, one per slot: ``[num_blocks, Hkv, 2, block_size * (D + 4)]``. When values
        are keys (``AttentionSpec.values_are_keys``) the key tile is alone:
        ``[num_blocks, Hkv, 1, ...]``."""
        row = self.spec.head_dim + (SCALE_BYTES if self.spec.kv_quantized else 0)
        return (num_blocks, self.spec.num_kv_heads, self.spec.kv_parts, block_size * row)

    def copy_slots(self, kv_cache: torch.Tensor, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """See ``AttentionBackend.copy_slots``: in the tiled layout a slot is a column of
        its block's key tile (a column of dimension pairs where bfloat16 keys are stored in
        pairs), a row of its value tile, and (quantized) one scale of each."""
        raw = kv_cache.view(torch.uint8) if self._kv_quantized else kv_cache
        head_dim = self.spec.head_dim
        block_size = raw.shape[-1] // (head_dim + (SCALE_BYTES if self._kv_quantized else 0))
        values_end = block_size * head_dim
        keys = raw[:, :, 0, :values_end]
        if raw.dtype == torch.bfloat16 and self._ops.bf16_key_pairs():
            keys = keys.unflatten(-1, (head_dim // 2, block_size, 2)).transpose(-2, -3)
        else:
            keys = keys.unflatten(-1, (head_dim, block_size)).transpose(-1, -2)
        parts = [keys]
        if raw.shape[2] == 2:  # a value tile (none when values are keys)
            parts.append(raw[:, :, 1, :values_end].unflatten(-1, (block_size, head_dim)))
        if self._kv_quantized:
            parts += [raw[:, :, i, values_end:].unflatten(-1, (block_size, SCALE_BYTES)) for i in range(raw.shape[2])]
        src_block, src_slot = sources // block_size, sources % block_size
        dst_block, dst_slot = destinations // block_size, destinations % block_size
        for part in parts:  # [blocks, Hkv, block_size, ...]
            part[dst_block, :, dst_slot] = part[src_block, :, src_slot]

    def build_metadata(self, layout: BatchLayout) -> CpuMetadata:
        """Sort requests into fresh prefills and cached-context requests."""
        window = self.spec.sliding_window
        fresh_starts, fresh_lengths, cached, start = [], [], [], 0
        tree_lens = layout.tree.lens if layout.tree is not None else (0,) * len(layout.query_lens)
        for r, (query_len, seq_len) in enumerate(zip(layout.query_lens, layout.seq_lens_list)):
            if query_len > 1 and reads_only_new_tokens(query_len, seq_len, window) and not tree_lens[r]:
                fresh_starts.append(start)
                fresh_lengths.append(query_len)
            else:
                cached.append(r)
            start += query_len
        return CpuMetadata(layout, tuple(fresh_starts), tuple(fresh_lengths), torch.tensor(cached, dtype=torch.int32))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: CpuMetadata, layer_index: int) -> torch.Tensor:
        """See ``AttentionBackend.forward``."""
        layout = meta.layout
        self._ops.write_kv_cache(kv_cache, k, v, layout.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.fresh_starts:
            if self._kv_quantized:  # the values the cache holds, as every later step reads them
                k, v = round_trip(k, self.spec.kv_dtype), round_trip(v, self.spec.kv_dtype)
            self._ops.causal_prefill_attention(out, q, k, v, meta.fresh_starts, meta.fresh_lengths, self.spec.scale)
        if meta.cached.numel():
            self._ops.paged_attention(out, q, kv_cache, layout.block_table, layout.query_start_loc, layout.seq_lens,
                                      meta.cached, self.spec.scale, self.spec.sliding_window or 0,
                                      *((layout.tree.mask, layout.tree.lens_tensor) if layout.tree else (None, None)))
        return out


SPEC = ComponentSpec("attention", "cpu", CpuAttention, CpuAttentionConfig,
                     "native C++ paged attention for CPU (reads the paged cache in place)")
