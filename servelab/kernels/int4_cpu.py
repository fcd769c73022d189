"""servelab's weight-only int4 CPU matmul (``torch.ops.servelab_cpu.int4_linear``,
``csrc/int4_linear.cpp``) and the weight layout it reads, built once at load.

The kernel reads servelab's group-wise int4 weights (``servelab/kernels/quantized_weights.py``)
as packed nibbles, half a byte per value, for any number of rows: at a few rows it widens
them to float32 in registers (one pass at memory speed), at more it dequantizes a tile of
the weight at a time into the core's cache; see docs/quantization.md. Its reference is
``F.linear(x, dequantize_int4(...))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelab.kernels.blocked_linear import BLOCK, PACK_CHANNELS, pack_blocks
from servelab.kernels.cpu_ops import native_cpu_ops
from servelab.kernels.quantized_weights import INT4_OFFSET


def pack_int4_blocks(qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight uint8 [N, K / 2], scales and zeros [N, G]) -> (packed uint8 [N' / 16, K / 2, 16],
    params float32 [N' / 16, G, 2, 16]), N' = N rounded up to a multiple of ``PACK_CHANNELS``
    (zero channels past N): ``packed[b, p, j] = qweight[16 b + j, p]``, ``params[b, g, 0, j]``
    the scale of channel 16 b + j in group g and ``params[b, g, 1, j]`` its offset
    ``zeros - 8 * scales``, so that ``w = q * scale + offset``."""
    return pack_blocks(qweight), int4_params(scales, zeros)


def int4_params(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """(scales and zeros [N, G]) -> float32 [N' / 16, G, 2, 16]: ``[b, g, 0, j]`` the scale of
    channel 16 b + j in group g, ``[b, g, 1, j]`` its offset ``zeros - 8 * scales`` (zeros
    past N), as the int4 kernels read them."""
    rows = scales.shape[0]
    scales, zeros = scales.float(), zeros.float()
    params = torch.stack((scales, zeros - INT4_OFFSET * scales), dim=-1)  # [N, G, 2]
    params = F.pad(params, (0, 0, 0, 0, 0, -rows % PACK_CHANNELS))
    params = params.view(-1, BLOCK, *params.shape[1:]).permute(0, 2, 3, 1)  # [N' / 16, G, 2, 16]
    return params.contiguous()


def int4_linear(x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) -> x @ dequantize_int4(...).T [M, out_features] float32,
    from ``pack_int4_blocks``' tensors (the group size is K / G)."""
    out = x.new_empty(x.shape[0], out_features)
    native_cpu_ops().int4_linear(out, x, packed, params)
    return out
