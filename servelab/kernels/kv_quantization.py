"""Quantized KV cache rows in torch: the reference of the cache-write kernels and the
dequantization the torch attention backends run (``cache.kv_dtype``, docs/quantization.md).

A quantized row is one (slot, KV head): ``D`` one-byte values followed by the 4 bytes of
its float32 scale, ``[..., D + 4]`` in the cache dtype. int8: symmetric, ``scale = amax /
127``, ``q = round_half_even(x / scale)``; float8_e4m3fn: ``scale = amax / 448``, ``q =
x / scale`` rounded to nearest even by the cast. ``x ~ q * scale``; an all-zero row has
scale 0.
"""

from __future__ import annotations

import torch

from servelab.core.kv_cache_dtype import SCALE_BYTES

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0


def quant_max(kv_dtype: torch.dtype) -> float:
    """The largest magnitude a quantized value takes (the scale maps each row's amax to it)."""
    return INT8_MAX if kv_dtype == torch.int8 else FP8_E4M3_MAX


def quantize_kv(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x`` [..., D] (any float dtype) -> packed rows [..., D + 4] of ``kv_dtype``."""
    head_dim = x.shape[-1]
    values = x.float()
    limit = quant_max(kv_dtype)
    scale = values.abs().amax(dim=-1, keepdim=True) / limit
    scaled = (values / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-limit, limit)
    packed = torch.empty(*x.shape[:-1], head_dim + SCALE_BYTES, dtype=kv_dtype, device=x.device)
    raw = packed.view(torch.uint8)
    quantized = scaled.round().to(torch.int8) if kv_dtype == torch.int8 else scaled.to(kv_dtype)
    raw[..., :head_dim] = quantized.view(torch.uint8)
    raw[..., head_dim:] = scale.view(torch.uint8)
    return packed


def dequantize_kv(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows [..., D + 4] -> values [..., D] in ``dtype`` (computed in float32)."""
    head_dim = packed.shape[-1] - SCALE_BYTES
    raw = packed.view(torch.uint8)
    scale = raw[..., head_dim:].contiguous().view(torch.float32)
    return (packed[..., :head_dim].float() * scale).to(dtype)


def round_trip(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a quantized cache gives it back: what attention over the cache reads."""
    return dequantize_kv(quantize_kv(x, kv_dtype), x.dtype)
