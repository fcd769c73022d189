"""Triton kernel: scatter new tokens' keys and values into their KV-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from servelab.kernels._checks import (
    check,
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
):
    """One program per token: copy its [Hkv, D] key and value into its slot."""
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
    k = tl.load(key_ptr + token * stride_kt + src, mask=mask)
    src = offs_h[:, None] * stride_vh + offs_d[None, :]
    v = tl.load(value_ptr + token * stride_vt + src, mask=mask)
    dst = kv_ptr + block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c0, v.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key[t]``/``value[t]`` ([T, Hkv, D]) into slot ``slot_mapping[t]`` (int64 [T]).

    ``kv_cache`` is ``[2, num_blocks, block_size, Hkv, D]``; slot = block_id *
    block_size + offset; a negative slot skips the row (e.g. padding).  In place.
    Slots are not range-checked (that would need a GPU sync): the caller owns them.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    check(key.dim() == 3 and key.shape[1:] == (num_kv_heads, head_dim),
          f"key must be [T, {num_kv_heads}, {head_dim}], got {tuple(key.shape)}")
    check(value.shape == key.shape, f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    check(key.dtype == kv_cache.dtype and value.dtype == kv_cache.dtype,
          f"key/value dtype ({key.dtype}, {value.dtype}) must match kv_cache dtype {kv_cache.dtype}")
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
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
