"""servelab's float32 CPU matmul (``torch.ops.servelab_cpu.float_linear``,
``csrc/blocked_linear.cpp``) and the blocked weight layout it shares with ``int8_linear``.

The weight is repacked once into blocks of 16 output channels stored along K, so each
tile of channels is one contiguous stream: at decode sizes one pass over the weight serves
every row of the batch and the matmul runs at memory speed; see docs/cpu_kernels.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelab.kernels.cpu_ops import native_cpu_ops

BLOCK = 16
"""Output channels per packed block (``kBlock`` in csrc/blocked_linear.cpp)."""
PACK_CHANNELS = 64
"""The packed channel count is padded to a multiple of this (``kPackChannels``)."""


def pack_blocks(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> packed [N' / 16, K, 16] of the same dtype, with N' = N rounded up
    to a multiple of ``PACK_CHANNELS`` (zero channels past N):
    ``packed[b, k, j] = weight[16 b + j, k]``."""
    rows, columns = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -rows % PACK_CHANNELS))
    return padded.view(padded.shape[0] // BLOCK, BLOCK, columns).transpose(1, 2).contiguous()


def float_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) -> x @ weight.T [M, out_features] float32, from
    ``pack_blocks``'s float32 tensor."""
    out = x.new_empty(x.shape[0], out_features)
    native_cpu_ops().float_linear(out, x, packed)
    return out
