"""How a model's layer windows become KV cache groups, what a block of them costs, and
the waste a cache that ignores windows reports."""

from __future__ import annotations

import pytest
import torch

from servelab.core.kv_cache import CacheContext, KVCacheGroup, KVCacheSpec, single_group
from servelab.core.model import ModelShape
from servelab.testing.cache_kit import WINDOWED_SPEC, make_request


def spec(windows: tuple[int | None, ...]) -> KVCacheSpec:
    """A spec of len(windows) layers of one 4-wide head in float32."""
    return KVCacheSpec(len(windows), 1, 4, torch.float32, 64, windows)


@pytest.mark.parametrize("windows,expected", [
    ((), [((0, 1, 2), None)]),
    ((8, 8, 8), [((0, 1, 2), 8)]),
    ((8, None, 8, None), [((0, 2), 8), ((1, 3), None)]),
    ((8, 8, 8, 8, 8, None) * 2, [((0, 1), 8), ((2, 3), 8), ((4, 6), 8), ((7, 8), 8), ((9, 10), 8),
                                 ((5, 11), None)]),
    ((8, None, 8), [((0,), 8), ((2,), 8), ((1,), None)]),
])
def test_layers_split_into_equal_groups_that_share_a_window(windows, expected):
    groups = spec(windows).groups if windows else spec((None,) * 3).groups
    assert [(group.layers, group.sliding_window) for group in groups] == expected
    assert len({len(group.layers) for group in groups}) == 1


def test_a_block_holds_one_groups_layers():
    grouped = spec((8, None, 8, None))
    assert grouped.block_bytes(16, grouped.groups) == 2 * 2 * 4 * 4 * 16
    assert grouped.block_bytes(16, single_group(grouped)) == grouped.bytes_per_token * 16 == 4 * 2 * 4 * 4 * 16
    assert single_group(grouped) == (KVCacheGroup((0, 1, 2, 3)),)


def test_pipeline_stages_with_mixed_windows_keep_one_group():
    shape = ModelShape(4, 2, 2, 8, 8, 64, 100, 16, 32, layer_windows=(8, None, 8, None))
    assert shape.kv_cache_spec(torch.float32, 64).layer_windows == (8, None, 8, None)
    assert shape.kv_cache_spec(torch.float32, 64, pipeline_parallel_size=2).layer_windows == ()
    assert shape.kv_cache_spec(torch.float32, 8).layer_windows == (None,) * 4, "a window as long as the context"


def paged(*overrides: str):
    from servelab.core.entrypoints.compose import compose_config
    from servelab.core.engine.registry import get_registry

    cfg = compose_config(["cache=paged", "cache.block_size=4", "cache.num_blocks=64", *overrides])
    registry = get_registry()
    return registry.build("cache", cfg.cache, CacheContext(WINDOWED_SPEC, registry))


def test_a_cache_that_ignores_windows_reports_their_tokens_as_waste():
    window = WINDOWED_SPEC.layer_windows[0]
    ignoring, grouped = paged("cache.groups=false"), paged()
    assert ignoring.groups == single_group(WINDOWED_SPEC) and len(grouped.groups) == 2
    for cache in (ignoring, grouped):
        request = make_request("r", 32)
        assert cache.allocate(request, 30) is not None
        request.num_computed_tokens = 30
        assert cache.allocate(request, 1) is not None
    # one of the two layers has stopped reading the tokens before its window
    assert ignoring.usage.unread_slots == (30 - window + 1) // 2
    assert ignoring.usage.waste > 0.3
    assert grouped.usage.unread_slots < grouped.block_size
    assert grouped.usage.used_blocks < ignoring.usage.used_blocks * 2 * 0.7


@pytest.mark.parametrize("window", [0, -4])
def test_a_window_that_is_no_token_count_names_the_field(tmp_path, window):
    from servelab import LLM
    from servelab.core.errors import ConfigError
    from servelab.testing import tiny_checkpoint

    folder = tiny_checkpoint(tmp_path / "mistral", "mistral", sliding_window=window)
    with pytest.raises(ConfigError, match=r"sliding_window must be a whole number of tokens >= 1"):
        LLM(folder)


def test_a_window_longer_than_the_context_is_full_attention(tmp_path):
    from servelab import LLM
    from servelab.testing import tiny_checkpoint

    folder = tiny_checkpoint(tmp_path / "mistral", "mistral", sliding_window=10_000)
    llm = LLM(folder, overrides=["model.max_model_len=128"])
    assert [group.sliding_window for group in llm.engine.cache.groups] == [None]
    llm.shutdown()
