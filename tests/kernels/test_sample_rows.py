"""The native sampler (``sample_rows``): every token it draws is one the torch path's filters
(temperature, top-k, top-p, min-p) keep, drawn as often as their probabilities say, for
every filter alone and together, vocabularies smaller and larger than its first
candidates; a seed gives the same token again; greedy rows take the first largest logit."""

from __future__ import annotations

import pytest
import torch

from servelab.core.request import Request
from servelab.core.sampling_params import SamplingParams
from servelab.kernels.cpu_ops import native_cpu_available
from servelab.plugins.decoding.logits_processing import apply_temperature_and_filters

pytestmark = pytest.mark.skipif(not native_cpu_available(), reason="native CPU ops are not built here")

FILTERS = [dict(), dict(temperature=0.5), dict(top_k=3), dict(top_p=0.9), dict(top_p=0.3, temperature=1.7),
           dict(min_p=0.05), dict(top_k=5, top_p=0.8, min_p=0.02, temperature=0.7), dict(top_k=1), dict(top_p=1e-6)]


def params_of(filters: dict) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **filters})


def torch_probs(logits: torch.Tensor, filters: dict) -> torch.Tensor:
    """The distribution sampler.py's torch path draws from."""
    requests = [Request(f"r{i}", [1], params_of(filters), eos_token_id=None) for i in range(logits.shape[0])]
    return apply_temperature_and_filters(logits.clone(), requests).softmax(dim=-1)


def native(logits: torch.Tensor, filters: list[dict], seeds: list[int]) -> torch.Tensor:
    params = [params_of(f) for f in filters]
    out = torch.empty(logits.shape[0], dtype=torch.long)
    torch.ops.servelab_cpu.sample_rows(out, logits.contiguous(), seeds, [0.0 if p.greedy else p.temperature
                                                                         for p in params],
                                       [p.top_k for p in params], [p.top_p for p in params],
                                       [p.min_p for p in params])
    return out


@pytest.mark.parametrize("filters", FILTERS, ids=[str(f) for f in FILTERS])
def test_draws_follow_the_torch_paths_distribution(filters):
    """20,000 seeds on one row of 9 tokens: each token as often as the torch path's
    probability (within 0.015; a frequency's standard deviation is at most 0.0036)."""
    logits = torch.tensor([[2.0, 1.5, 1.4, 0.3, -0.2, -1.0, 0.9, 1.6, -3.0]])
    draws = 20000
    tokens = native(logits.expand(draws, -1), [filters] * draws, list(range(draws)))
    frequencies = torch.bincount(tokens, minlength=9).double() / draws
    expected = torch_probs(logits, filters)[0].double()
    assert (frequencies[expected == 0] == 0).all(), "a token the filters remove was drawn"
    assert (frequencies - expected).abs().max() < 0.015, (frequencies, expected)


@pytest.mark.parametrize("vocab", [300, 5000])
@pytest.mark.parametrize("filters", FILTERS, ids=[str(f) for f in FILTERS])
def test_every_draw_is_a_kept_token(vocab, filters):
    generator = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=generator) * 3
    tokens = native(logits, [filters] * rows, list(range(rows)))
    kept = torch_probs(logits, filters) > 0
    assert kept[torch.arange(rows), tokens].all()
    if filters.get("top_k") == 1 or filters.get("top_p") == 1e-6:
        assert torch.equal(tokens, logits.argmax(dim=-1))


def test_a_flat_row_needs_more_than_the_first_candidates():
    """Near-uniform rows: top-p keeps thousands of tokens, past the first 64 sorted; the
    draws spread over them and stay inside them."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 20000, generator=generator) * 0.01
    tokens = native(logits.expand(400, -1), [dict(top_p=0.5)] * 400, list(range(400)))
    kept = torch_probs(logits, dict(top_p=0.5))[0] > 0
    assert 9000 < int(kept.sum()) < 11000
    assert kept[tokens].all() and tokens.unique().numel() > 350


def test_a_seed_repeats_its_token_and_greedy_rows_take_the_first_largest():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1500, generator=generator)
    logits[1] = logits[0]  # the same row and seed: the same token
    logits[5, :] = 1.0  # all tied: the first
    filters = [dict(), dict(), dict(top_p=0.9), dict(temperature=0.0), dict(temperature=0.0), dict(temperature=0.0)]
    first = native(logits, filters, [7, 7, 7, 0, 0, 0])
    assert torch.equal(native(logits, filters, [7, 7, 7, 0, 0, 0]), first)
    assert first[0] == first[1]
    assert torch.equal(first[3:], logits[3:].argmax(dim=-1)) and first[5] == 0
    assert native(logits[:1].expand(50, -1), [dict()] * 50, list(range(50))).unique().numel() > 10


def test_bad_shapes_are_refused():
    logits = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="one seed, temperature, top_k, top_p and min_p per row"):
        torch.ops.servelab_cpu.sample_rows(torch.empty(2, dtype=torch.long), logits, [1], [1.0], [0], [1.0], [0.0])
    with pytest.raises(RuntimeError, match="logits must be a contiguous float32"):
        torch.ops.servelab_cpu.sample_rows(torch.empty(2, dtype=torch.long), logits.double(), [1] * 2, [1.0] * 2,
                                           [0] * 2, [1.0] * 2, [0.0] * 2)
