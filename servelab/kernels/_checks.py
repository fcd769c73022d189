"""Argument checks shared by the kernel wrappers (no triton import here).

The checks look only at shapes, dtypes, devices and strides: nothing reads
tensor values, so the wrappers never force a GPU sync and stay capturable in
CUDA graphs.
"""

from __future__ import annotations

import numbers

import torch

from servelab.core.kv_cache_dtype import SCALE_BYTES, is_quantized, quantized_kv_dtypes
from servelab.kernels.availability import triton_interpret_enabled, triton_unavailable_reason

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond holds (unlike assert, survives ``python -O``)."""
    if not cond:
        raise ValueError(msg)


def window_constexpr(sliding_window: int | None) -> int:
    """The kernels' WINDOW: ``sliding_window`` (a positive int) or 0 for full attention."""
    if sliding_window is None:
        return 0
    check(isinstance(sliding_window, numbers.Integral) and sliding_window >= 1,
          f"sliding_window must be None or a positive int, got {sliding_window!r}")
    return int(sliding_window)


def check_runnable(device: torch.device) -> None:
    """Raise RuntimeError if Triton kernels cannot be launched on ``device``."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and triton_interpret_enabled():
        return
    reason = triton_unavailable_reason() or (
        f"tensors on device '{device}' cannot be used by the Triton kernels; "
        "use CUDA tensors (or CPU tensors with TRITON_INTERPRET=1)"
    )
    raise RuntimeError(reason)


def check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    """Every tensor must live on ``device``."""
    for name, t in tensors.items():
        check(t.device == device, f"{name} is on {t.device}, expected {device}")


def check_kv_cache(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (``[1, ...]``: keys
    alone, which are also the values; ``head_dim + 4`` bytes per row when int8 /
    float8_e4m3fn: values, then their float32 scale); return (num_blocks, block_size,
    num_kv_heads, head_dim)."""
    check(kv_cache.dim() == 5 and kv_cache.shape[0] in (1, 2),
          f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim] (or [1, ...] when values are "
          f"keys), got {tuple(kv_cache.shape)}")
    allowed = FLOAT_DTYPES + quantized_kv_dtypes()
    check(kv_cache.dtype in allowed, f"kv_cache dtype {kv_cache.dtype} not in {allowed}")
    check(kv_cache.stride(-1) == 1, "kv_cache must be contiguous in head_dim (stride(-1) == 1)")
    _, num_blocks, block_size, num_kv_heads, row = kv_cache.shape
    head_dim = row - SCALE_BYTES if is_quantized(kv_cache.dtype) else row
    check(head_dim >= 1, f"a quantized kv_cache row holds head_dim values and a 4-byte scale, got {row} bytes")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_cache_dtype(kv_cache: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    """The cache holds ``dtype`` (``name``'s) or quantized values."""
    check(kv_cache.dtype == dtype or is_quantized(kv_cache.dtype),
          f"kv_cache dtype {kv_cache.dtype} must be {name}'s dtype {dtype}, int8 or float8_e4m3fn")


def check_index_tensor(t: torch.Tensor, name: str, shape: tuple, dtype: torch.dtype) -> None:
    """Check an integer metadata tensor's exact shape and dtype (``-1`` = any size)."""
    check(t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}")
    check(t.dim() == len(shape) and all(s == -1 or s == n for s, n in zip(shape, t.shape)),
          f"{name} must have shape {shape}, got {tuple(t.shape)}")
    check(t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1,
          f"{name} must be contiguous in its last dimension")


def check_block_table(block_table: torch.Tensor, num_reqs: int) -> None:
    """``block_table`` is ``[num_reqs, max_blocks]`` int32, rows may be strided."""
    check_index_tensor(block_table, "block_table", (num_reqs, -1), torch.int32)
    check(block_table.shape[1] >= 1, "block_table needs at least one column")


def check_attention_out(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Return ``out`` (checked to match ``like``) or a fresh ``empty_like`` tensor."""
    if out is None:
        return torch.empty_like(like)
    check(out.shape == like.shape, f"out shape {tuple(out.shape)} != {tuple(like.shape)}")
    check(out.dtype == like.dtype, f"out dtype {out.dtype} != {like.dtype}")
    check(out.device == like.device, f"out is on {out.device}, expected {like.device}")
    check(out.stride(-1) == 1, "out must be contiguous in head_dim")
    return out

