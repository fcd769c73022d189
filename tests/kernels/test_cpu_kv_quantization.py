"""The native CPU ops over a quantized KV cache (``cache.kv_dtype`` int8 / fp8_e4m3):
the write stores what the torch reference stores, in attention=cpu's tiled layout, and
paged attention dequantizes as the reference does."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.cpu_ops import native_cpu_unavailable_reason
from servelab.kernels.kv_quantization import quantize_kv
from servelab.kernels.varlen_attention_reference import varlen_paged_attention_reference

pytestmark = pytest.mark.skipif(native_cpu_unavailable_reason() is not None,
                                reason=f"native CPU ops: {native_cpu_unavailable_reason()}")

FP8 = getattr(torch, "float8_e4m3fn", None)
KV_DTYPES = [torch.int8] + ([FP8] if FP8 is not None else [])
IDS = ["int8", "fp8"][:len(KV_DTYPES)]
SCENARIOS = {
    "decode": [(1, 1), (50, 1), (97, 1), (16, 1)],
    "mixed": [(57, 1), (30, 30), (88, 12), (40, 0), (65, 5)],
}


def tiled(packed: torch.Tensor) -> torch.Tensor:
    """A quantized standard cache [2, blocks, block_size, Hkv, D + 4] in attention=cpu's
    layout [blocks, Hkv, 2, block_size * (D + 4)]: per (block, head) the keys transposed
    ([D][block_size]) and their block_size float32 scales, then the values row-major and
    theirs."""
    raw = packed.view(torch.uint8)
    blocks, block_size, heads, row = raw.shape[1:]
    head_dim = row - 4
    keys = raw[0, ..., :head_dim].permute(0, 2, 3, 1).reshape(blocks, heads, -1)
    values = raw[1, ..., :head_dim].permute(0, 2, 1, 3).reshape(blocks, heads, -1)
    key_scales, value_scales = (raw[i, ..., head_dim:].permute(0, 2, 1, 3).reshape(blocks, heads, -1) for i in (0, 1))
    parts = [torch.cat([keys, key_scales], -1), torch.cat([values, value_scales], -1)]
    return torch.stack(parts, dim=2).contiguous().view(packed.dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_quantizes_as_the_reference(kv_dtype, dtype):
    """Same bytes (values and scales) as quantize_kv, placed in the tiled layout; slot -1 skipped."""
    blocks, block_size, heads, head_dim = 5, 4, 2, 16
    k, v = torch.randn(2, 6, heads, head_dim).to(dtype) * 5
    slots = torch.tensor([0, 7, 9, 19, -1, 3], dtype=torch.int64)
    keep = slots >= 0
    standard = torch.zeros(2, blocks * block_size, heads, head_dim + 4, dtype=kv_dtype)
    for i, rows in enumerate((k, v)):
        standard.view(torch.uint8)[i, slots[keep]] = quantize_kv(rows[keep], kv_dtype).view(torch.uint8)
    cache = torch.zeros(blocks, heads, 2, block_size * (head_dim + 4), dtype=kv_dtype)
    torch.ops.servelab_cpu.write_kv_cache(cache, k, v, slots)
    expected = tiled(standard.view(2, blocks, block_size, heads, head_dim + 4))
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("block_size,gqa,dtype", [(16, 4, torch.float32), (1, 2, torch.bfloat16),
                                                  (32, 1, torch.float32)])
def test_paged_attention_over_quantized_cache(paged_batch, close, kv_dtype, scenario, block_size, gqa, dtype):
    """Every request's rows equal the reference over the same quantized cache."""
    seq_lens, query_lens = zip(*SCENARIOS[scenario])
    batch = paged_batch(list(seq_lens), list(query_lens), 2 * gqa, 2, 32, block_size, dtype)
    batch["kv_cache"] = quantize_kv(batch["kv_cache"], kv_dtype)
    expected = varlen_paged_attention_reference(**batch)
    out = torch.zeros_like(batch["q"])
    torch.ops.servelab_cpu.paged_attention(out, batch["q"], tiled(batch["kv_cache"]), batch["block_table"],
                                           batch["query_start_loc"], batch["seq_lens"],
                                           torch.arange(len(seq_lens), dtype=torch.int32), batch["scale"], 0)
    close(out, expected)
