"""Pure-torch reference for writing new tokens' keys/values into the KV cache."""

from __future__ import annotations

import torch

from servelab.core.kv_cache_dtype import is_quantized
from servelab.kernels.kv_quantization import quantize_kv


def write_kv_cache_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key[t]``/``value[t]`` ([T, Hkv, D]) into slot ``slot_mapping[t]`` of ``kv_cache``.

    ``kv_cache`` is ``[2, num_blocks, block_size, Hkv, D]`` (``[1, ...]``: keys alone,
    ``value`` not stored) and slot = block_id *
    block_size + offset; rows whose slot is negative are skipped.  In place.  An int8 /
    float8_e4m3fn cache (rows of D + 4) gets ``kv_quantization.quantize_kv``'s rows.
    """
    if is_quantized(kv_cache.dtype):
        key = quantize_kv(key, kv_cache.dtype).view(torch.uint8)
        value = quantize_kv(value, kv_cache.dtype).view(torch.uint8)
        kv_cache = kv_cache.view(torch.uint8)
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() and int(slots.max()) >= kv_cache.shape[1] * block_size:
        raise ValueError("slot_mapping has a slot beyond the cache")
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[keep].to(kv_cache.dtype)
    if kv_cache.shape[0] == 2:
        kv_cache[1, blocks, offsets] = value[keep].to(kv_cache.dtype)
