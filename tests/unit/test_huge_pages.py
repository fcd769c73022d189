"""KV cache tensors on transparent huge pages."""

from __future__ import annotations

import sys

import pytest
import torch

from servelab.platform import HUGE_PAGE_BYTES, huge_page_zeros


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux-only")
def test_large_tensors_start_on_a_huge_page_boundary_and_are_zero():
    t = huge_page_zeros((2, 300, 2, 1024), torch.bfloat16)
    assert t.shape == (2, 300, 2, 1024) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not t.any()
    t[1, 299, 1, 1023] = 1.0  # the last element is inside the region
    assert t.sum().item() == 1.0


def test_small_tensors_are_plain_zeros():
    t = huge_page_zeros((4, 8), torch.float32)
    assert t.shape == (4, 8) and not t.any()


def test_engine_kv_cache_uses_it(llama):
    from servelab import LLM, SamplingParams

    llm = LLM(llama, overrides=["model.dtype=float32", "cache.num_blocks=2048"])
    caches = llm.engine.executor.kv_caches
    assert caches[0].numel() * caches[0].element_size() >= HUGE_PAGE_BYTES
    if sys.platform.startswith("linux"):
        assert all(c.data_ptr() % HUGE_PAGE_BYTES == 0 for c in caches)
    outputs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3
