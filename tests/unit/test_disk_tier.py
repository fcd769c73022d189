"""``cache.lower_tier=disk``: blocks the host tier evicts are saved to files and loaded back
on a prefix hit, across restarts; damaged files and failed writes are recomputed."""

from __future__ import annotations

import errno
import logging

import pytest

from servelab import LLM, ConfigError, SamplingParams
from servelab.testing import tiny_checkpoint
from servelab.testing.oracle import (assert_no_leaked_blocks, assert_tiers_whole, hot_prefix_prompts,
                                     transformers_greedy)

ENGINE = ["model.dtype=float32", "device=cpu", "model.max_model_len=128", "cache.block_size=4",
          "cache.enable_prefix_caching=true", "cache.num_blocks=40", "scheduler.max_num_seqs=1",
          "cache.host_cache_bytes=20000"]


def disk(folder) -> list[str]:
    return ["cache.lower_tier=disk", "cache.lower_tier_bytes=4000000", f"cache.lower_tier_path={folder}"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("disk") / "llama", "llama")


@pytest.fixture(scope="module")
def expected(checkpoint):
    return transformers_greedy(checkpoint, hot_prefix_prompts(), 4)


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in hot_prefix_prompts()]


def run(checkpoint, overrides) -> tuple[list[list[int]], LLM]:
    """Generate the hot-prefix prompts one at a time; the engine is shut down after the
    checks that need it, so its saves are on disk."""
    llm = LLM(checkpoint, overrides=[*ENGINE, *overrides])
    got = generate(llm)
    assert_no_leaked_blocks(llm)
    assert_tiers_whole(llm)
    llm.engine.shutdown()
    return got, llm


def block_files(folder):
    return sorted(folder.glob("*/*.kv"))


def test_a_restarted_engine_serves_prefixes_saved_to_disk(checkpoint, expected, tmp_path):
    got, first = run(checkpoint, disk(tmp_path))
    assert got == expected
    lower = first.engine.cache.lower
    assert lower.index.stored_blocks > 0 and lower.index.hit_tokens > 0
    saved = len(block_files(tmp_path))
    assert saved == len(lower.index)
    got, second = run(checkpoint, disk(tmp_path))
    assert got == expected
    lower = second.engine.cache.lower
    assert lower.warm_blocks == saved and lower.index.hit_tokens > first.engine.cache.lower.index.hit_tokens


def test_another_model_does_not_read_the_blocks(checkpoint, expected, tmp_path, tmp_path_factory):
    run(checkpoint, disk(tmp_path))
    other = tiny_checkpoint(tmp_path_factory.mktemp("other") / "llama", "llama", seed=1)
    _, llm = run(other, disk(tmp_path))
    assert llm.engine.cache.lower.warm_blocks == 0
    assert len(list(tmp_path.iterdir())) == 2


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "garbage"])
def test_damaged_files_are_recomputed_not_loaded(checkpoint, expected, tmp_path, damage, caplog):
    run(checkpoint, disk(tmp_path))
    files = block_files(tmp_path)
    for path in files:
        content = path.read_bytes()
        if damage == "corrupt":
            path.write_bytes(content[:-8] + bytes(8 * [0x5A]))
        elif damage == "truncate":
            path.write_bytes(content[:len(content) // 2])
        else:
            path.write_bytes(b"not a block")
    with caplog.at_level(logging.WARNING, logger="servelab.plugins.kv_tier.disk"):
        got, llm = run(checkpoint, disk(tmp_path))
    assert got == expected
    lower = llm.engine.cache.lower
    if damage == "garbage":  # no readable header: not listed at all
        assert lower.warm_blocks == 0
    else:
        assert lower.failed_loads > 0 and "recomputing that block" in caplog.text


def test_a_full_disk_is_logged_and_recomputed(checkpoint, expected, tmp_path, monkeypatch, caplog):
    from servelab.plugins.kv_tier import disk as disk_tier

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier.os, "replace", no_space)
    with caplog.at_level(logging.WARNING, logger="servelab.plugins.kv_tier.disk"):
        got, llm = run(checkpoint, disk(tmp_path))
    assert got == expected
    assert "No space left on device" in caplog.text and not block_files(tmp_path)
    assert llm.engine.cache.lower.failed_loads > 0


@pytest.mark.parametrize("index", ["hash", "radix"])
def test_speculative_decoding_and_n_over_the_disk_tier(checkpoint, tmp_path, index):
    prompts = hot_prefix_prompts()
    expected = transformers_greedy(checkpoint, prompts, 8)
    llm = LLM(checkpoint, overrides=[*ENGINE, *disk(tmp_path), "decoding=ngram", f"cache.prefix_index={index}"])
    got = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
           for p in prompts]
    assert got == expected and llm.engine.cache.lower.index.hit_tokens > 0
    llm = LLM(checkpoint, overrides=[*ENGINE, *disk(tmp_path), "scheduler.max_num_seqs=3", f"cache.prefix_index={index}"])
    outputs = llm.generate([prompts[0]], SamplingParams(n=3, temperature=0.0, max_tokens=8), use_tqdm=False)
    assert [c.token_ids for c in outputs[0].outputs] == [expected[0]] * 3
    assert_no_leaked_blocks(llm)
    assert_tiers_whole(llm)


@pytest.mark.parametrize("overrides,problem", [
    (["cache.enable_prefix_caching=true", "cache.lower_tier=disk", "cache.lower_tier_bytes=4000000",
      "cache.lower_tier_path=/tmp"], "cache.lower_tier=disk loads blocks through the host tier"),
    (["cache.enable_prefix_caching=true", "cache.host_cache_bytes=2000000", "cache.lower_tier=disk",
      "cache.lower_tier_bytes=10", "cache.lower_tier_path=/tmp"], "cache.lower_tier_bytes=10 holds no block"),
    (["cache.enable_prefix_caching=true", "cache.host_cache_bytes=2000000", "cache.lower_tier=disk",
      "cache.lower_tier_bytes=4000000"], "set cache.lower_tier_path"),
    (["cache.enable_prefix_caching=true", "cache.host_cache_bytes=2000000", "cache.lower_tier=tape",
      "cache.lower_tier_bytes=4000000"], "tape"),
    (["cache.enable_prefix_caching=true", "cache.host_cache_bytes=2000000", "cache.lower_tier=disk",
      "cache.lower_tier_bytes=4000000", "cache.lower_tier_path=/tmp", "parallel.tensor_parallel_size=2"],
     "cache.lower_tier runs its I/O in the engine's process"),
])
def test_bad_lower_tier_settings_name_the_field(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        LLM("toy", overrides=overrides)


def test_an_unwritable_folder_is_refused_at_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cache.lower_tier_path=.*is not a writable folder"):
        LLM("toy", overrides=["cache.enable_prefix_caching=true", "cache.host_cache_bytes=2000000", *disk(blocker)])


def test_cache_events_follow_blocks_down_the_tiers(tmp_path):
    from servelab.core.kv_cache import apply_cache_events

    llm = LLM("toy", overrides=[*ENGINE, *disk(tmp_path)])
    cache = llm.engine.cache
    cache.start_events()
    generate(llm)
    events = cache.take_events()
    assert {e.tier for e in events if e.kind == "moved"} == {"host", "disk"}
    held, below = set(), set()
    apply_cache_events(held, events, below)
    on_device = {digest for (group, digest) in cache.prefix._block_of}
    assert below and not below & on_device
    assert below <= {d for d in below if d in cache.host_tier or d in cache.lower.index}
    assert held - below == on_device
