"""servelab's quantized weight format and its pure-torch reference (quantize, dequantize).

A float weight ``w`` [N, K] (N output features, K input features) becomes:

- int8 (per output channel, symmetric): ``qweight`` int8 [N, K] and ``scales`` float32
  [N]; ``w[n, k] = qweight[n, k] * scales[n]``, with ``scales[n] = max_k |w[n, k]| / 127``.
- int4 (groups of ``group_size`` input features, asymmetric): ``qweight`` uint8 [N, K / 2]
  holding two 4-bit values ``q`` in 0..15 per byte (the low nibble is the even input
  feature, the high nibble the next odd one), ``scales`` and ``zeros`` float32
  [N, K / group_size]; ``w[n, k] = (q[n, k] - 8) * scales[n, g] + zeros[n, g]`` with
  ``g = k // group_size``: the group's minimum maps to 0 and its maximum to 15.

Every row (and every group) is quantized on its own, so quantizing a checkpoint tensor
and then taking rows or whole groups of columns of it gives what quantizing that part
would: fused and tensor-parallel layers load the same tensors (see docs/quantization.md).
"""

from __future__ import annotations

import torch

INT8_MAX = 127
INT4_LEVELS = 15
INT4_OFFSET = 8
MIN_SCALE = 1e-8
"""The smallest scale: an all-zero row or constant group quantizes to zeros, not NaN."""


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (qweight int8 [N, K], scales float32 [N])."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=MIN_SCALE)
    qweight = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return qweight, scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(qweight int8 [N, K], scales [N]) -> weight [N, K] in ``dtype``."""
    return (qweight.float() * scales.float()[:, None]).to(dtype)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] float (K a multiple of ``group_size``, which is even) ->
    (qweight uint8 [N, K / 2], scales float32 [N, K / group_size], zeros float32 [N, K / group_size])."""
    rows, columns = weight.shape
    assert columns % group_size == 0 and group_size % 2 == 0, (columns, group_size)
    groups = weight.float().reshape(rows, columns // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / INT4_LEVELS).clamp(min=MIN_SCALE)
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, INT4_LEVELS).to(torch.uint8)
    zeros = low + INT4_OFFSET * scales
    return pack_int4(q.reshape(rows, columns)), scales, zeros


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """(qweight uint8 [N, K / 2], scales and zeros [N, K / group_size]) -> weight [N, K] in ``dtype``."""
    q = unpack_int4(qweight).float()
    rows, columns = q.shape
    groups = q.reshape(rows, scales.shape[1], -1)
    weight = (groups - INT4_OFFSET) * scales.float()[..., None] + zeros.float()[..., None]
    return weight.reshape(rows, columns).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] with values 0..15 -> uint8 [N, K / 2], even column in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> q uint8 [N, K] with values 0..15 (inverse of ``pack_int4``)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
