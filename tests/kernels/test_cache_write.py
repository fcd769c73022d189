"""write_kv_cache (Triton) vs write_kv_cache_reference: exact equality of the whole cache."""

from __future__ import annotations

import pytest
import torch

from servelab.kernels.cache_write_reference import write_kv_cache_reference


@pytest.fixture
def write():
    """The Triton wrapper (imported lazily: skipped when triton is missing)."""
    return pytest.importorskip("servelab.kernels.cache_write").write_kv_cache


def make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
    """A cache filled with random values (so untouched slots are checked too)."""
    return torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype).to(device)


@pytest.mark.parametrize("block_size", [1, 16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(write, device, block_size, dtype):
    """Random distinct slots, some rows skipped (slot -1), shuffled over all blocks."""
    num_tokens, num_kv_heads, head_dim = 40, 2, 48
    num_blocks = max(2, -(-3 * num_tokens // block_size))
    cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    expected = cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype).to(device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::5] = -1
    slots = slots.to(device)
    write(key, value, cache, slots)
    write_kv_cache_reference(key, value, expected, slots)
    assert torch.equal(cache, expected)
    kept = slots >= 0
    assert torch.equal(cache[0].flatten(0, 1)[slots[kept]], key[kept])
    assert torch.equal(cache[1].flatten(0, 1)[slots[kept]], value[kept])


def test_strided_key_value_views(write, device):
    """key/value may be head-slices of a fused qkv tensor (non-contiguous token stride)."""
    num_tokens, num_kv_heads, head_dim = 12, 2, 32
    cache = make_cache(4, 16, num_kv_heads, head_dim, torch.float32, device)
    expected = cache.clone()
    qkv = torch.randn(num_tokens, 8, head_dim, device=device)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.arange(5, 5 + num_tokens, device=device)
    write(key, value, cache, slots)
    write_kv_cache_reference(key, value, expected, slots)
    assert torch.equal(cache, expected)


def test_all_skipped_and_empty(write, device):
    """Only negative slots, or no tokens at all, leave the cache untouched."""
    cache = make_cache(2, 16, 2, 32, torch.float32, device)
    before = cache.clone()
    key = torch.randn(3, 2, 32, device=device)
    write(key, key, cache, torch.full((3,), -1, dtype=torch.int64, device=device))
    write(key[:0], key[:0], cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(cache, before)


def test_rejects_bad_arguments(write, device):
    """Wrong slot dtype, mismatched shapes or dtypes raise ValueError."""
    cache = make_cache(2, 16, 2, 32, torch.float32, device)
    key = torch.randn(3, 2, 32, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError):
        write(key, key, cache, slots.to(torch.int32))
    with pytest.raises(ValueError):
        write(key, key[:, :1], cache, slots)
    with pytest.raises(ValueError):
        write(key.half(), key.half(), cache, slots)
    with pytest.raises(ValueError):
        write(key, key, cache, slots[:2])
