"""servelab's weight-only int8 CPU matmul (``torch.ops.servelab_cpu.int8_linear``,
``csrc/blocked_linear.cpp``) on the blocked weight layout of ``servelab/kernels/blocked_linear.py``,
built once at load.

The kernel widens int8 weights to float32 in registers inside a blocked matmul, so a
weight crosses memory as one byte per value instead of four; see docs/quantization.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelab.kernels.blocked_linear import PACK_CHANNELS, pack_blocks
from servelab.kernels.cpu_ops import native_cpu_ops


def pack_int8(qweight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight int8 [N, K], scales [N]) -> (packed int8 [N' / 16, K, 16], scales float32 [N'])
    with N' = N rounded up to a multiple of ``PACK_CHANNELS`` (zero channels past N):
    ``packed[b, k, j] = qweight[16 b + j, k]``."""
    return pack_blocks(qweight), F.pad(scales.float(), (0, -qweight.shape[0] % PACK_CHANNELS)).contiguous()


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) -> x @ (qweight * scales).T [M, out_features] float32,
    from ``pack_int8``'s tensors."""
    out = x.new_empty(x.shape[0], out_features)
    native_cpu_ops().int8_linear(out, x, packed, scales)
    return out
