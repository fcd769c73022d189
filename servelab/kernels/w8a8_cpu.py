"""servelab's int8 x int8 CPU matmul (``torch.ops.servelab_cpu.w8a8_linear``,
``csrc/w8a8_linear.cpp``): int8 weights, activations quantized to int8 per row at each
call, int8 dot products (AVX512-VNNI; AMX tiles from a few rows on, where the CPU has
them); the weight layout it reads, built once at load; and its torch reference."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from servelab.kernels.cpu_ops import native_cpu_ops, native_cpu_unavailable_reason

BLOCK = 16
"""Output channels per packed block (``kBlock`` in csrc/w8a8_linear.cpp)."""
PACK_CHANNELS = 64
"""The packed channel count is padded to a multiple of this (``kPackChannels``)."""
PACK_INPUTS = 64
"""The packed input count is padded to a multiple of this (``kPackInputs``: one AMX tile row)."""
ACTIVATION_OFFSET = 128
"""The kernel stores a quantized activation q as the unsigned byte q + 128."""


@functools.lru_cache(maxsize=None)
def w8a8_unavailable_reason() -> str | None:
    """Why ``w8a8_linear`` cannot run on this machine (None when it can)."""
    reason = native_cpu_unavailable_reason()
    if reason is not None:
        return f"it needs servelab's native CPU ops, which are unavailable: {reason}"
    if not native_cpu_ops().supports_w8a8():
        return "it needs a CPU with AVX512-VNNI (int8 dot products); this one has none"
    return None


def pack_w8a8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qweight int8 [N, K], scales [N]) -> (packed int8 [N' / 16, K' / 4, 64], offsets int32
    [N'] = 128 * sum_k qweight[n, k], scales float32 [N']), N' and K' = N and K rounded up to
    multiples of 64 (zeros past them): ``packed[b, k4, 4 j + i] = qweight[16 b + j, 4 k4 + i]``."""
    rows, columns = qweight.shape
    padded = F.pad(qweight, (0, -columns % PACK_INPUTS, 0, -rows % PACK_CHANNELS))
    packed = padded.view(-1, BLOCK, padded.shape[1] // 4, 4).transpose(1, 2).reshape(-1, padded.shape[1] // 4,
                                                                                      4 * BLOCK)
    offsets = ACTIVATION_OFFSET * padded.sum(dim=1, dtype=torch.int32)
    return packed.contiguous(), offsets, F.pad(scales.float(), (0, -rows % PACK_CHANNELS)).contiguous()


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor,
                out_features: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) -> [M, out_features] float32: each row of x quantized
    to int8 (``quantize_rows``) times the int8 weight, from ``pack_w8a8``'s tensors."""
    out = x.new_empty(x.shape[0], out_features)
    native_cpu_ops().w8a8_linear(out, x, packed, offsets, scales)
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q int8 [M, K], scales float32 [M]): ``x[m] ~ q[m] * scales[m]``,
    ``scales[m] = max |x[m]| / 127`` (1 for a zero row), rounded to nearest even."""
    largest = x.abs().amax(dim=1)
    step = torch.where(largest > 0, largest / 127, torch.ones_like(largest))
    return torch.round(x * (1 / step)[:, None]).to(torch.int8), step


def w8a8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What ``w8a8_linear`` computes, in torch: the exact integer dot products of
    ``quantize_rows(x)`` and ``qweight``, times both scales (float32 [M, N])."""
    q, step = quantize_rows(x)
    dots = q.long() @ qweight.long().T
    return dots.float() * (step[:, None] * scales.float()[None, :])
