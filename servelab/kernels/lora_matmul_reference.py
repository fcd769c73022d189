"""Pure-torch reference for the segmented LoRA matmul (``lora_segment_matmul``): a loop over
segments, each multiplied by its slot's weight in float32."""

from __future__ import annotations

import torch


def lora_segment_matmul_reference(x: torch.Tensor, weights: torch.Tensor, seg_starts: torch.Tensor,
                                  seg_slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for ``lora_segment_matmul`` (same arguments): rows ``seg_starts[i] ..
    seg_starts[i + 1] - 1`` of ``x`` times ``weights[seg_slots[i]]``, added to ``out`` (zeros
    when None); segments of slot -1 are left alone. Computes in float32, returns ``out``'s
    dtype (x's when None)."""
    result = (torch.zeros(x.shape[0], weights.shape[2], dtype=torch.float32, device=x.device) if out is None
              else out.float())
    starts = seg_starts.tolist()
    for index, slot in enumerate(seg_slots.tolist()):
        if slot >= 0:
            rows = slice(starts[index], starts[index + 1])
            result[rows] += x[rows].float() @ weights[slot].float()
    return result.to(x.dtype if out is None else out.dtype)
