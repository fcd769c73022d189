"""Quantized KV caches (``cache.kv_dtype`` int8 / fp8_e4m3): the torch reference's error
bound, the Triton cache write and attention kernels against it, and the attention over a
quantized cache against the float cache it approximates."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.cache_write_reference import write_kv_cache_reference
from servelab.kernels.kv_quantization import dequantize_kv, quant_max, quantize_kv
from servelab.kernels.varlen_attention_reference import varlen_paged_attention_reference

FP8 = getattr(torch, "float8_e4m3fn", None)
KV_DTYPES = [torch.int8] + ([FP8] if FP8 is not None else [])
IDS = ["int8", "fp8"][:len(KV_DTYPES)]
# Largest error of attention over the quantized cache against the float cache, on unit
# normal keys and values (mean |output| about 0.2): int8 keeps about 8 bits, fp8 4.
FLOAT_TOLERANCE = {torch.int8: 0.02, FP8: 0.12}
MIXED = [(57, 1), (30, 30), (88, 12), (65, 5)]


def quantized(batch: dict, kv_dtype: torch.dtype) -> dict:
    """``batch`` with its float cache replaced by the quantized one."""
    return {**batch, "kv_cache": quantize_kv(batch["kv_cache"], kv_dtype)}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
def test_round_trip_error_is_bounded_per_row(kv_dtype):
    """int8: half a step (amax / 254) per value; fp8: 2^-4 of the value, or half the
    smallest subnormal step of the row's scale; zero rows stay zero."""
    x = torch.randn(64, 4, 32) * torch.logspace(-3, 3, 64)[:, None, None]
    x[0, 0] = 0
    back = dequantize_kv(quantize_kv(x, kv_dtype), torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if kv_dtype == torch.int8:
        bound = amax / (2 * quant_max(kv_dtype)) * (1 + 1e-5)
    else:
        bound = torch.maximum(x.abs() / 16, amax / quant_max(kv_dtype) * 2.0 ** -10) * (1 + 1e-5)
    assert ((back - x).abs() <= bound).all()
    assert (back[0, 0] == 0).all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
def test_reference_attention_over_quantized_cache_is_close_to_float(paged_batch, kv_dtype):
    """What every backend computes from a quantized cache stays near the float answer."""
    seq_lens, query_lens = zip(*MIXED)
    batch = paged_batch(list(seq_lens), list(query_lens), 4, 2, 32, 16, torch.float32)
    expected = varlen_paged_attention_reference(**batch)
    actual = varlen_paged_attention_reference(**quantized(batch, kv_dtype))
    error = (actual - expected).abs().max().item()
    assert 0 < error < FLOAT_TOLERANCE[kv_dtype]


@pytest.fixture
def kernels():
    """The Triton wrappers (cache write, varlen, decode)."""
    cache_write = pytest.importorskip("servelab.kernels.cache_write")
    varlen = pytest.importorskip("servelab.kernels.varlen_attention")
    decode = pytest.importorskip("servelab.kernels.decode_attention")
    return cache_write.write_kv_cache, varlen.varlen_paged_attention, decode.paged_decode_attention


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_cache_write_matches_reference(kernels, device, kv_dtype, dtype):
    """Same bytes as the torch reference: values and scales (slot -1 skipped)."""
    write, _, _ = kernels
    key, value = torch.randn(2, 9, 2, 24, device=device).to(dtype) * 3
    slots = torch.tensor([5, 0, 17, -1, 31, 8, 9, 16, 2], device=device)
    expected = torch.zeros(2, 4, 8, 2, 28, dtype=kv_dtype, device=device)
    actual = expected.clone()
    write_kv_cache_reference(key, value, expected, slots)
    write(key, value, actual, slots)
    assert torch.equal(actual.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu())


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_attention_reads_quantized_cache(kernels, paged_batch, close, device, kv_dtype, dtype):
    """varlen (mixed batch) and decode kernels dequantize as the reference does."""
    _, varlen, decode = kernels
    seq_lens, query_lens = zip(*MIXED)
    batch = quantized(paged_batch(list(seq_lens), list(query_lens), 4, 2, 32, 16, dtype, device), kv_dtype)
    close(varlen(**batch), varlen_paged_attention_reference(**batch))
    decode_batch = quantized(paged_batch([40, 97, 3], [1, 1, 1], 4, 1, 32, 16, dtype, device), kv_dtype)
    expected = varlen_paged_attention_reference(**decode_batch)
    close(decode(decode_batch["q"], decode_batch["kv_cache"], decode_batch["seq_lens"], decode_batch["block_table"],
                 decode_batch["scale"], max_seq_len=97), expected)


def test_triton_refuses_a_cache_of_another_float_dtype(kernels, paged_batch, device):
    """A float cache must match the query's dtype; only int8 / fp8 caches may differ."""
    _, varlen, _ = kernels
    batch = paged_batch([8], [8], 2, 2, 16, 16, torch.float32, device)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        varlen(**{**batch, "kv_cache": batch["kv_cache"].bfloat16()})
