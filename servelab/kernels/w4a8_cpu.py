"""servelab's int4 x int8 CPU matmul (``torch.ops.servelab_cpu.w4a8_linear``,
``csrc/w4a8_linear.cpp``): group-wise int4 weights (servelab's format,
``servelab/kernels/quantized_weights.py``), activations quantized to int8 per row at each
call, int8 dot products of the nibbles (AVX512-VNNI, as ``w8a8_linear``); the weight
layout it reads, built once at load; its torch reference; and weight-only int4 on the same
weight and dot products (``int4_sliced_linear``: each row split into int8 slices)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from servelab.kernels.blocked_linear import BLOCK, PACK_CHANNELS
from servelab.kernels.cpu_ops import native_cpu_ops
from servelab.kernels.int4_cpu import int4_params
from servelab.kernels.quantized_weights import INT4_OFFSET, unpack_int4
from servelab.kernels.w8a8_cpu import quantize_rows

STEP_INPUTS = 8
"""Inputs per 64-byte step of a packed block (``kStepInputs``): the group size is a multiple
of this (``core.quantization.W4A8_GROUP_MULTIPLE`` checks it at start-up)."""


def pack_w4a8(qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight uint8 [N, K / 2], scales and zeros [N, G]) -> (packed uint8 [N' / 16, K / 8, 64],
    params float32 [N' / 16, G, 2, 16] as ``int4_params`` gives), N' = N rounded up to a
    multiple of ``PACK_CHANNELS`` (zero channels past N): ``packed[b, t, 4 j + i] =
    q[16 b + j, 8 t + i] | q[16 b + j, 8 t + 4 + i] << 4``."""
    q = unpack_int4(qweight)
    rows, columns = q.shape
    q = F.pad(q, (0, 0, 0, -rows % PACK_CHANNELS))
    steps = q.view(-1, BLOCK, columns // STEP_INPUTS, 2, 4)  # [blocks, j, t, half, i]
    packed = (steps[..., 0, :] | (steps[..., 1, :] << 4)).transpose(1, 2)  # [blocks, t, j, i]
    return packed.reshape(-1, columns // STEP_INPUTS, 4 * BLOCK).contiguous(), int4_params(scales, zeros)


def w4a8_linear(x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) -> [M, out_features] float32: each row of x quantized
    to int8 (``quantize_rows``) times the int4 weight, from ``pack_w4a8``'s tensors."""
    out = x.new_empty(x.shape[0], out_features)
    native_cpu_ops().w4a8_linear(out, x, packed, params)
    return out


def int4_sliced_linear(x: torch.Tensor, packed: torch.Tensor, params: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) -> x @ W.T [M, out_features] float32 for the int4
    weight of ``pack_w4a8``'s tensors, weight-only: each row of x split into two int8
    slices (exact to about 1.6e-5 of its largest value: ``int8_sliced_linear``'s first
    two) multiplied as ``w4a8_linear`` multiplies its rows, the slices' results summed."""
    out = x.new_empty(x.shape[0], out_features)
    native_cpu_ops().int4_sliced_linear(out, x, packed, params)
    return out


def w4a8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          zeros: torch.Tensor) -> torch.Tensor:
    """What ``w4a8_linear`` computes, in torch: per group, the exact integer dot products of
    ``quantize_rows(x)`` with the nibbles times the group's scale, plus its offset times
    the group's activation sum, times the row's scale (float32 [M, N])."""
    q, step = quantize_rows(x)
    nibbles = unpack_int4(qweight).long()
    groups = scales.shape[1]
    rows = q.long().view(q.shape[0], groups, q.shape[1] // groups)  # [M, G, group]
    dots = torch.einsum("mgk,ngk->mng", rows, nibbles.view(nibbles.shape[0], groups, -1)).float()
    offsets = zeros.float() - INT4_OFFSET * scales.float()
    grouped = dots * scales.float()[None] + rows.sum(dim=-1).float()[:, None, :] * offsets[None]
    return grouped.sum(dim=-1) * step[:, None]
