"""The native sampler (``sample_rows``): the token the torch path (temperature, top-k,
top-p, min-p, then the exponential race) draws from the same logits and noise, for every
filter alone and together, vocabularies smaller and larger than its first candidates, rows
of one request each and batches mixing them with greedy rows (the first largest logit)."""

from __future__ import annotations

import pytest
import torch

from servelab.core.request import Request
from servelab.core.sampling_params import SamplingParams
from servelab.kernels.cpu_ops import native_cpu_available
from servelab.plugins.decoding.logits_processing import apply_temperature_and_filters

pytestmark = pytest.mark.skipif(not native_cpu_available(), reason="native CPU ops are not built here")

FILTERS = [dict(), dict(temperature=0.5), dict(top_k=5), dict(top_p=0.9), dict(top_p=0.3, temperature=1.7),
           dict(min_p=0.05), dict(top_k=40, top_p=0.8, min_p=0.02, temperature=0.7), dict(top_k=1), dict(top_p=1e-6)]


def requests_with(params: list[dict]) -> list[Request]:
    return [Request(f"r{i}", [1], SamplingParams(**{"temperature": 1.0, **p}), eos_token_id=None)
            for i, p in enumerate(params)]


def torch_path(logits: torch.Tensor, noise: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """sampler.py's torch path with the given noise (greedy rows: the argmax)."""
    tokens = apply_temperature_and_filters(logits.clone(), requests).softmax(dim=-1).div(noise).argmax(dim=-1)
    greedy = torch.tensor([r.sampling_params.greedy for r in requests])
    return torch.where(greedy, logits.argmax(dim=-1), tokens)


def native(logits: torch.Tensor, noise: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    params = [r.sampling_params for r in requests]
    out = torch.empty(logits.shape[0], dtype=torch.long)
    torch.ops.servelab_cpu.sample_rows(out, logits, noise, [0.0 if p.greedy else p.temperature for p in params],
                                       [p.top_k for p in params], [p.top_p for p in params],
                                       [p.min_p for p in params])
    return out


def rows_of(count: int, vocab: int, seed: int, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(count, vocab, generator=generator) * scale,
            torch.empty(count, vocab).exponential_(generator=generator))


@pytest.mark.parametrize("vocab", [7, 300, 2048, 5000])
@pytest.mark.parametrize("filters", FILTERS, ids=[str(f) for f in FILTERS])
def test_native_sampler_draws_the_torch_paths_token(vocab, filters):
    logits, noise = rows_of(64, vocab, vocab)
    requests = requests_with([filters] * 64)
    expected = torch_path(logits, noise, requests)
    assert torch.equal(native(logits, noise, requests), expected)
    if filters.get("top_k") == 1 or filters.get("top_p") == 1e-6:
        assert torch.equal(expected, logits.argmax(dim=-1))


def test_a_batch_mixes_each_rows_filters_and_greedy_rows():
    params = [FILTERS[i % len(FILTERS)] for i in range(27)] + [dict(temperature=0.0)] * 3
    logits, noise = rows_of(len(params), 1500, 0, scale=2.0)
    logits[-1, :] = 1.0  # all tied: the first
    noise[-3:] = float("nan")  # a greedy row's noise is not read
    requests = requests_with(params)
    expected = torch_path(logits, noise, requests)
    assert expected[-1] == 0
    assert torch.equal(native(logits, noise, requests), expected)


def test_a_flat_row_needs_more_than_the_first_candidates():
    """Near-uniform rows: top-p keeps thousands of tokens, past the first 64 sorted."""
    logits, noise = rows_of(8, 20000, 1, scale=0.01)
    requests = requests_with([dict(top_p=0.5)] * 8)
    assert torch.equal(native(logits, noise, requests), torch_path(logits, noise, requests))


def test_bad_shapes_are_refused():
    logits = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="one temperature, top_k, top_p and min_p per row"):
        torch.ops.servelab_cpu.sample_rows(torch.empty(2, dtype=torch.long), logits, torch.ones(2, 10), [1.0], [0],
                                           [1.0], [0.0])
    with pytest.raises(RuntimeError, match="logits and noise must be contiguous float32"):
        torch.ops.servelab_cpu.sample_rows(torch.empty(2, dtype=torch.long), logits, torch.ones(2, 9), [1.0] * 2,
                                           [0] * 2, [1.0] * 2, [0.0] * 2)
