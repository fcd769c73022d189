"""servelab's weight-only int8 CPU matmuls, on a weight repacked once at load.

On a CPU with AVX512-VNNI, ``int8_sliced_linear`` (``csrc/w8a8_linear.cpp``, on w8a8's
packed layout) splits each float32 input row into three int8 slices (the row quantized,
then what it left out quantized on a 254x finer scale, twice: exact to about 6e-8 of the
row's largest value) and multiplies them with int8 dot products, summing the slices'
results. Elsewhere ``int8_linear`` (``csrc/blocked_linear.cpp``, on the blocked layout of
``servelab/kernels/blocked_linear.py``) widens each weight to float32 in registers. Either
way a weight crosses memory as one byte per value instead of four; see docs/quantization.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelab.kernels.blocked_linear import PACK_CHANNELS, pack_blocks
from servelab.kernels.cpu_ops import native_cpu_ops
from servelab.kernels.w8a8_cpu import w8a8_unavailable_reason


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


def slices_on_dot_products() -> bool:
    """True where weight-only layers multiply on int8 dot products (a CPU with AVX512-VNNI
    and the native ops built): int8 through ``int8_sliced_linear``, int4 in groups of
    multiples of 8 through ``int4_sliced_linear``; else through ``int8_linear`` and
    ``int4_linear``."""
    return w8a8_unavailable_reason() is None


def int8_sliced_linear(x: torch.Tensor, packed: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor,
                       out_features: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) -> x @ (qweight * scales).T [M, out_features] float32,
    each row of x split into int8 slices, from ``pack_w8a8``'s tensors."""
    out = x.new_empty(x.shape[0], out_features)
    native_cpu_ops().int8_sliced_linear(out, x, packed, offsets, scales)
    return out
