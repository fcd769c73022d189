"""Triton kernel: scatter new tokens' keys and values into their KV-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.core.kv_cache_dtype import is_quantized
from servelab.kernels._checks import (
    check,
    check_cache_dtype,
    check_index_tensor,
    check_kv_cache,
    check_runnable,
    check_same_device,
    next_pow2,
)
from servelab.kernels._triton_utils import check_launchable
from servelab.kernels.cache_write_reference import write_kv_cache_reference

__all__ = ["write_kv_cache", "write_kv_cache_reference"]


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, kv_ptr, slot_ptr,
    stride_kt, stride_kh,        # key [T, Hkv, D]
    stride_vt, stride_vh,        # value [T, Hkv, D]
    stride_c0, stride_cb, stride_cs, stride_ch,  # kv_cache [2, blocks, block_size, Hkv, D]
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,     # int8 / float8 cache: rows of D values, then a float32 scale
    IS_INT8: tl.constexpr,
    WRITE_VALUE: tl.constexpr,   # False: a cache of keys alone (values are keys)
):
    """One program per token: copy its [Hkv, D] key and value into its slot (quantized
    per KV head when the cache is)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src = offs_h[:, None] * stride_kh + offs_d[None, :]
    k = tl.load(key_ptr + token * stride_kt + src, mask=mask, other=0.0)
    src = offs_h[:, None] * stride_vh + offs_d[None, :]
    v = tl.load(value_ptr + token * stride_vt + src, mask=mask, other=0.0)
    rows = kv_ptr + block * stride_cb + offset * stride_cs + offs_h * stride_ch
    dst = rows[:, None] + offs_d[None, :]
    if QUANTIZED:
        _store_quantized(k, dst, rows, mask, offs_h < NUM_KV_HEADS, HEAD_DIM, IS_INT8)
        if WRITE_VALUE:
            _store_quantized(v, dst + stride_c0, rows + stride_c0, mask, offs_h < NUM_KV_HEADS, HEAD_DIM, IS_INT8)
    else:
        tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
        if WRITE_VALUE:
            tl.store(dst + stride_c0, v.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_quantized(x, dst, rows, mask, row_mask, HEAD_DIM: tl.constexpr, IS_INT8: tl.constexpr):
    """Quantize rows ``x`` [BLOCK_H, BLOCK_D] as ``kv_quantization.quantize_kv`` does (IEEE
    divisions, int8 rounded half to even) into ``dst``; each row's scale after its values."""
    limit: tl.constexpr = 127.0 if IS_INT8 else 448.0
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.math.div_rn(amax, tl.zeros_like(amax) + limit)
    divisor = tl.maximum(scale, 1.1754943508222875e-38)  # float32's smallest normal
    scaled = tl.math.div_rn(x, tl.zeros_like(x) + divisor[:, None])
    scaled = tl.minimum(tl.maximum(scaled, -limit), limit)
    if IS_INT8:
        tl.store(dst, _round_half_even(scaled).to(tl.int8), mask=mask)
    else:
        tl.store(dst, _round_to_e4m3(scaled).to(dst.dtype.element_ty), mask=mask)
    tl.store((rows + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale, mask=row_mask)


@triton.jit
def _round_half_even(x):
    """``x`` rounded to the nearest integer, ties to even (as torch.round)."""
    rounded = tl.floor(x + 0.5)
    odd = rounded - 2.0 * tl.floor(rounded * 0.5) != 0.0
    return tl.where((rounded - x == 0.5) & odd, rounded - 1.0, rounded)


@triton.jit
def _round_to_e4m3(x):
    """float32 ``x`` (|x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, in
    float32 arithmetic: 3 mantissa bits below 2**exponent, subnormal steps of 2**-9. The
    cast that follows is then exact (Triton's interpreter drops the carry into the exponent
    when its own cast rounds up to a power of two)."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    return _round_half_even(x / step) * step


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key[t]``/``value[t]`` ([T, Hkv, D]) into slot ``slot_mapping[t]`` (int64 [T]).

    ``kv_cache`` is ``[2, num_blocks, block_size, Hkv, D]`` (``[1, ...]``: keys alone,
    ``value`` is not stored); slot = block_id *
    block_size + offset; a negative slot skips the row (e.g. padding).  In place.  An
    int8 / float8_e4m3fn cache has rows of D + 4 bytes: the quantized values, then their
    float32 scale (``kv_quantization.quantize_kv``).
    Slots are not range-checked (that would need a GPU sync): the caller owns them.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    check(key.dim() == 3 and key.shape[1:] == (num_kv_heads, head_dim),
          f"key must be [T, {num_kv_heads}, {head_dim}], got {tuple(key.shape)}")
    check(value.shape == key.shape, f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    check(value.dtype == key.dtype, f"value dtype {value.dtype} != key dtype {key.dtype}")
    check_cache_dtype(kv_cache, key.dtype, "key")
    check(key.stride(-1) == 1 and value.stride(-1) == 1, "key and value must be contiguous in head_dim")
    num_tokens = key.shape[0]
    check_index_tensor(slot_mapping, "slot_mapping", (num_tokens,), torch.int64)
    device = kv_cache.device
    check_same_device(device, key=key, value=value, slot_mapping=slot_mapping)
    check_runnable(device)
    check_launchable(_write_kv_cache_kernel, device)
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        BLOCK_SIZE=block_size,
        QUANTIZED=is_quantized(kv_cache.dtype),
        IS_INT8=kv_cache.dtype == torch.int8,
        WRITE_VALUE=kv_cache.shape[0] == 2,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
