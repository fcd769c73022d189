"""The segmented LoRA matmul kernel against its torch reference: segments of several
slots, of no slot, empty and longer than a tile, writing and accumulating."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.lora_matmul_reference import lora_segment_matmul_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [False, True])
def test_segments_use_their_slots(device, close, dtype, accumulate):
    from servelab.kernels.lora_matmul import lora_segment_matmul

    lengths, slots = [1, 19, 0, 3, 1, 7], [2, 0, 1, -1, 2, 1]
    starts = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    seg_slots = torch.tensor(slots, dtype=torch.int32, device=device)
    x = torch.randn(sum(lengths), 24, device=device).to(dtype)
    weights = torch.randn(3, 24, 20, device=device).to(dtype)
    out = torch.randn(sum(lengths), 20, device=device, dtype=torch.float32) if accumulate else None
    expected = lora_segment_matmul_reference(x, weights, starts, seg_slots, None if out is None else out.clone())
    got = lora_segment_matmul(x, weights, starts, seg_slots, out)
    close(got, expected)
    if not accumulate:
        assert not got[20:23].any(), "rows of a segment without a slot must stay zero"


def test_bad_shapes_are_refused(device):
    from servelab.kernels.lora_matmul import lora_segment_matmul

    x = torch.randn(4, 8, device=device)
    starts = torch.tensor([0, 4], dtype=torch.int32, device=device)
    slots = torch.tensor([0], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"weights must be \[slots, K=8, N\]"):
        lora_segment_matmul(x, torch.randn(1, 6, 4, device=device), starts, slots)
    with pytest.raises(ValueError, match="must be int32"):
        lora_segment_matmul(x, torch.randn(1, 8, 4, device=device), starts.long(), slots)
