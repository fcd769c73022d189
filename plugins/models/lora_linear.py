"""Projection layers with LoRA adapters in slots, applied per token group.

``LoRALinear`` wraps a projection of any type (``Linear``, ``QuantizedLinear``, ...) and
adds, for the tokens of each adapter in the step, ``B(A(x))`` (the scale is folded into
``B``) to the base layer's output: the adapted tokens gathered once in slot order, two
small matmuls per adapter over its consecutive rows (grouped low-rank matmuls), one
scatter-add of the result. On CUDA the step's tokens come as segments
(one per request) with their slots instead, and ``servelab/kernels/lora_matmul.py``
multiplies every adapter's tokens in two Triton launches per layer (Punica-style
segmented gather matmuls). A fused projection (q/k/v, gate/up) holds each
adapted part's columns of ``A`` side by side and its ``B`` rows at that part's output
rows, so one pair of matmuls serves every part.

The step's token groups live in one ``LoRABatch`` that every wrapped layer of a model
reads: set once per step before the forward pass.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRABatch:
    """The current step's adapted tokens: ``rows`` [N] int64, the step's rows of every
    token that has an adapter, ordered by slot (None: every token, already in that order);
    ``groups``, (slot, start, end) per slot: its tokens are ``rows[start:end]``; empty when
    no token of the step has an adapter. ``segments``, for the Triton kernel instead:
    (starts int32 [R + 1], slots int32 [R]), each request's token rows and slot (-1: none),
    or None."""

    def __init__(self):
        self.rows: torch.Tensor | None = None
        self.groups: list[tuple[int, int, int]] = []
        self.segments: tuple[torch.Tensor, torch.Tensor] | None = None


class LoRALinear(nn.Module):
    """``base(x)`` plus each slot's low-rank update for its tokens. ``lora_a``
    [slots, in_features, width] and ``lora_b`` [slots, width, out_features] hold the slots'
    weights (``width``: ``max_rank`` per fused part); ``widths[s]`` is how many columns
    slot ``s`` uses (0: its adapter leaves this layer alone)."""

    def __init__(self, base: nn.Module, batch: LoRABatch, num_slots: int, width: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.base = base
        self.batch = batch
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_buffer("lora_a", torch.zeros(num_slots, self.in_features, width, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(num_slots, width, self.out_features, dtype=dtype, device=device),
                             persistent=False)
        self.widths = [0] * num_slots

    def clear(self, slot: int) -> None:
        """Empty ``slot`` (its next adapter is written from column 0)."""
        if self.widths[slot]:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            self.widths[slot] = 0

    def place(self, slot: int, first_row: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add one adapted part to ``slot``: ``a`` [rank, in_features], ``b`` [rows, rank]
        (scaled), landing on output rows ``first_row .. first_row + rows - 1``."""
        start, rank = self.widths[slot], a.shape[0]
        self.lora_a[slot, :, start:start + rank] = a.t()
        self.lora_b[slot, start:start + rank, first_row:first_row + b.shape[0]] = b.t()
        self.widths[slot] = start + rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] -> [T, out_features]."""
        out = self.base(x)
        if self.batch.segments is not None:
            from servelab.kernels.lora_matmul import lora_segment_matmul

            starts, slots = self.batch.segments
            shrunk = lora_segment_matmul(x, self.lora_a, starts, slots)
            return lora_segment_matmul(shrunk, self.lora_b, starts, slots, out)
        groups = [group for group in self.batch.groups if self.widths[group[0]]]
        if not groups:
            return out
        rows = self.batch.rows
        adapted = x if rows is None else x.index_select(0, rows)
        delta = out.new_zeros(adapted.shape[0], self.out_features)
        for slot, start, end in groups:
            width = self.widths[slot]
            torch.mm(adapted[start:end] @ self.lora_a[slot, :, :width], self.lora_b[slot, :width],
                     out=delta[start:end])
        if rows is None:
            return out.add_(delta)
        return out.index_add_(0, rows, delta)


def projections(layers: nn.Module) -> list[tuple[str, nn.Module, nn.Module, int]]:
    """Every projection of ``layers`` (a module with ``in_features`` and ``out_features``:
    ``Linear``, ``QuantizedLinear``, ...) as (its name, its parent, itself, how many
    checkpoint parts it fuses: its parent's ``fused_counts``, else 1)."""
    found = []
    for path, parent in layers.named_modules():
        counts = getattr(parent, "fused_counts", dict)()
        for child, module in parent.named_children():
            if not isinstance(module, LoRALinear) and hasattr(module, "in_features") and \
                    hasattr(module, "out_features"):
                found.append((f"{path}.{child}" if path else child, parent, module, counts.get(child, 1)))
    return found


def wrap_projections(layers: nn.Module, batch: LoRABatch, num_slots: int, max_rank: int, dtype: torch.dtype,
                     device: torch.device, prefix: str) -> dict[str, LoRALinear]:
    """Wrap every projection of ``layers`` in a ``LoRALinear`` of ``num_slots`` slots with
    room for ``max_rank`` per fused part; returns them by full name (``prefix`` + their
    name in ``layers``)."""
    wrapped = {}
    for name, parent, module, fused in projections(layers):
        wrapper = LoRALinear(module, batch, num_slots, max_rank * fused, dtype, device)
        setattr(parent, name.rpartition(".")[2], wrapper)
        wrapped[prefix + name] = wrapper
    return wrapped
