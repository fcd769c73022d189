"""Workload generators: deterministic under a seed, matching the statistics they promise."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from servelab.bench.arrivals import arrival_offsets
from servelab.bench.config import WorkloadConfig
from servelab.bench.lengths import clamp_lengths, lognormal_length
from servelab.bench.workload import TokenSpace, build_workload, warmup_workload
from servelab.core.errors import ConfigError
from servelab.checkpoints.toy import byte_level_tokenizer

SPACE = TokenSpace(257, 512, byte_level_tokenizer())


def workload(**fields) -> WorkloadConfig:
    return WorkloadConfig(**fields)


def test_same_seed_same_requests_other_seed_other_requests():
    cfg = workload(num_requests=20, arrival="poisson", rate=5.0)
    assert build_workload(cfg, SPACE) == build_workload(cfg, SPACE)
    other = build_workload(workload(num_requests=20, arrival="poisson", rate=5.0, seed=1), SPACE)
    assert other != build_workload(cfg, SPACE)


def test_streams_are_independent():
    """Changing the lengths keeps the arrivals (and vice versa)."""
    a = build_workload(workload(num_requests=10, arrival="poisson", lengths="fixed"), SPACE)
    b = build_workload(workload(num_requests=10, arrival="poisson", lengths="uniform"), SPACE)
    assert [r.arrival_offset_s for r in a] == [r.arrival_offset_s for r in b]


@pytest.mark.parametrize("kind, burstiness", [("poisson", 1.0), ("gamma", 0.25), ("gamma", 4.0)])
def test_arrivals_match_rate_and_burstiness(kind, burstiness):
    offsets = arrival_offsets(kind, 20000, 8.0, burstiness, random.Random(0))
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.05)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness if kind == "gamma" else 1.0), rel=0.08)


def test_all_at_once_and_bad_arrivals():
    assert arrival_offsets("all_at_once", 3, 0.0, 1.0, random.Random(0)) == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="workload.rate must be > 0"):
        arrival_offsets("poisson", 3, 0.0, 1.0, random.Random(0))
    with pytest.raises(ConfigError, match="workload.arrival must be one of"):
        arrival_offsets("bursty", 3, 1.0, 1.0, random.Random(0))


def test_fixed_and_uniform_lengths():
    fixed = build_workload(workload(num_requests=5, lengths="fixed", input_len=40, output_len=7), SPACE)
    assert {(len(r.prompt_token_ids), r.max_tokens) for r in fixed} == {(40, 7)}
    requests = build_workload(workload(num_requests=2000, input_range=[10, 20], output_range=[3, 5]), SPACE)
    prompts = [len(r.prompt_token_ids) for r in requests]
    outputs = [r.max_tokens for r in requests]
    assert min(prompts) == 10 and max(prompts) == 20 and min(outputs) == 3 and max(outputs) == 5
    assert statistics.fmean(prompts) == pytest.approx(15, rel=0.03)
    with pytest.raises(ConfigError, match="workload.input_range"):
        build_workload(workload(input_range=[20, 10]), SPACE)


def test_sharegpt_lognormal_means():
    rng = random.Random(0)
    samples = [lognormal_length(161.31, 1.0, rng) for _ in range(40000)]
    assert statistics.fmean(samples) == pytest.approx(161.31, rel=0.03)
    big = TokenSpace(257, 1 << 20, byte_level_tokenizer())
    requests = build_workload(workload(num_requests=20000, lengths="sharegpt"), big)
    assert statistics.fmean(len(r.prompt_token_ids) for r in requests) == pytest.approx(161.31, rel=0.05)
    assert statistics.fmean(r.max_tokens for r in requests) == pytest.approx(337.99, rel=0.05)


def test_long_prompt_fills_the_context():
    requests = build_workload(workload(num_requests=200, lengths="long_prompt", output_range=[8, 32]), SPACE)
    for r in requests:
        assert 0.5 * 512 - 1 <= len(r.prompt_token_ids) <= 0.9 * 512 and 8 <= r.max_tokens <= 32


def test_clamping_keeps_every_request_inside_the_context():
    assert clamp_lengths(1000, 1000, 512) == (256, 256)
    assert clamp_lengths(500, 20, 512) == (492, 20)
    requests = build_workload(workload(num_requests=500, lengths="sharegpt"), SPACE)
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 512 for r in requests)


def test_shared_prefixes():
    cfg = workload(num_requests=40, prefix_len=32, num_prefixes=2, input_range=[8, 16])
    requests = build_workload(cfg, SPACE)
    heads = {r.prompt_token_ids[:32] for r in requests}
    assert len(heads) == 2
    assert len({r.prompt_token_ids[32:] for r in requests}) == 40
    assert all(40 <= len(r.prompt_token_ids) <= 48 for r in requests)


def test_random_prompts_avoid_special_tokens():
    requests = build_workload(workload(num_requests=50), SPACE)
    eos = SPACE.tokenizer.eos_token_id
    assert all(eos not in r.prompt_token_ids and max(r.prompt_token_ids) < 257 for r in requests)


def test_corpus_prompts_are_windows_of_the_corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    text = "def add(a, b):\n    return a + b\n" * 3
    corpus.write_text(text)
    cfg = workload(num_requests=10, prompts="corpus", corpus_file=str(corpus), input_range=[5, 200])
    tokens = SPACE.tokenizer.encode(text, add_special_tokens=False)
    wrapped = tokens * 4  # prompts longer than the corpus wrap around
    for r in build_workload(cfg, SPACE):
        ids, n = list(r.prompt_token_ids), len(r.prompt_token_ids)
        assert any(wrapped[s:s + n] == ids for s in range(len(tokens))), "not a window of the corpus"
    with pytest.raises(ConfigError, match="corpus_file"):
        build_workload(workload(prompts="corpus"), SPACE)


def test_warmup_requests_are_short_and_distinct():
    warm = warmup_workload(SPACE, 3)
    assert [r.request_id for r in warm] == ["warmup-0", "warmup-1", "warmup-2"]
    assert all(len(r.prompt_token_ids) == 16 and r.max_tokens == 4 for r in warm)


def test_trace_replays_arrivals_and_lengths(tmp_path):
    from servelab.bench.trace import shipped_trace

    path = tmp_path / "t.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n10.0,30,5\n10.5,12,7\n12.0,40,3\n")
    requests = build_workload(workload(num_requests=3, arrival="trace", lengths="trace", path=str(path)), SPACE)
    assert [r.arrival_offset_s for r in requests] == [0.0, 0.5, 2.0]
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in requests] == [(30, 5), (12, 7), (40, 3)]
    faster = build_workload(workload(num_requests=3, arrival="trace", lengths="trace", path=str(path),
                                     trace_rate=4.0), SPACE)
    assert [r.arrival_offset_s for r in faster] == pytest.approx([0.0, 0.125, 0.5])
    shipped = build_workload(workload(num_requests=100, arrival="trace", lengths="trace",
                                      path=shipped_trace("conversation")), TokenSpace(32000, 4096, None))
    assert len(shipped) == 100 and shipped[0].arrival_offset_s == 0.0


@pytest.mark.parametrize("path, message", [(None, "workload.path is not set"),
                                           ("/no/such.csv", "cannot be read")])
def test_trace_problems_name_the_field(path, message):
    with pytest.raises(ConfigError, match=message):
        build_workload(workload(num_requests=3, arrival="trace", lengths="trace", path=path), SPACE)


def test_trace_with_too_few_rows_says_so(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,3,3\n")
    with pytest.raises(ConfigError, match="num_requests=5 but the trace"):
        build_workload(workload(num_requests=5, arrival="trace", lengths="trace", path=str(path)), SPACE)
