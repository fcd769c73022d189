"""Greedy output equals transformers' for every registered scheduler x cache x attention."""

from __future__ import annotations

import itertools

import pytest

from servelab import LLM
from servelab.core.engine.registry import get_registry
from servelab.core.errors import ConfigError
from servelab.testing import assert_engine_matches_transformers, mixed_prompts

REGISTRY = get_registry()
INTERPRETED = ("flash",)
"""Backends whose kernels run in Triton's interpreter on CPU: slow, so they get shorter prompts."""
SELECTORS = ("auto",)
"""Options that stand for another backend (tested in tests/unit/test_auto_attention.py)."""
SCHEDULERS, CACHES = sorted(REGISTRY.specs("scheduler")), sorted(REGISTRY.specs("cache"))
BACKENDS = sorted(set(REGISTRY.specs("attention")) - set(INTERPRETED) - set(SELECTORS))
COMBINATIONS = list(itertools.product(SCHEDULERS, CACHES, BACKENDS))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("scheduler,cache,attention", COMBINATIONS)
def test_every_combination_matches_transformers(checkpoints, family, scheduler, cache, attention, attention_env):
    """Token-for-token equality on a batch of mixed-length prompts, no leaked blocks."""
    attention_env(attention)
    assert_engine_matches_transformers(
        checkpoints[family], [f"scheduler={scheduler}", f"cache={cache}", f"attention={attention}",
                              "cache.memory_bytes=4000000"])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("scheduler,cache", list(itertools.product(SCHEDULERS, CACHES)))
@pytest.mark.parametrize("attention", INTERPRETED)
def test_interpreted_kernels_match_transformers(checkpoints, family, scheduler, cache, attention, attention_env):
    """The Triton backend on a short mixed batch (prefill, chunk-free decode, both caches)."""
    attention_env(attention)
    folder = checkpoints[family]
    prompts = mixed_prompts(257, lengths=(3, 17, 9))
    assert_engine_matches_transformers(folder, [f"scheduler={scheduler}", f"cache={cache}", f"attention={attention}",
                                                "cache.memory_bytes=4000000"], prompts=prompts, max_tokens=5)


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_other_families_match_transformers(checkpoints, family):
    """Llama 3 rope scaling and Mistral load and match too."""
    assert_engine_matches_transformers(checkpoints[family])


def test_sliding_window_matches_transformers(tmp_path):
    """A Mistral window shorter than the sequence is applied like transformers does."""
    from servelab.testing import tiny_checkpoint

    folder = tiny_checkpoint(tmp_path / "mistral-window", "mistral", sliding_window=16)
    for attention in ("naive", "sdpa", "cpu"):
        assert_engine_matches_transformers(folder, [f"attention={attention}"], max_tokens=20)


def test_tied_embeddings_match_transformers(tmp_path):
    """With tie_word_embeddings the LM head multiplies by the embedding matrix itself (one
    parameter, prepacked on the CPU like any linear layer)."""
    from servelab import LLM
    from servelab.testing import tiny_checkpoint

    folder = tiny_checkpoint(tmp_path / "llama-tied", "llama", tie_word_embeddings=True)
    assert_engine_matches_transformers(folder)
    model = LLM(folder, overrides=["model.dtype=float32"]).engine.executor.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


@pytest.mark.parametrize("attention", ["sdpa", "naive", "cpu"])
def test_large_batch_of_decodes_matches_transformers(llama, attention):
    """48 requests of mixed lengths: sdpa splits the decodes into length buckets, cpu
    spreads (request, KV heads) items over threads."""
    prompts = mixed_prompts(257, lengths=[3 + (i * 37) % 90 for i in range(48)], seed=3)
    assert_engine_matches_transformers(llama, [f"attention={attention}", "cache.block_size=8"], prompts=prompts,
                                       max_tokens=6)


FAMILY_REPRESENTATIVES = ("phi3", "opt", "falcon-new", "gemma2", "gemma3", "deepseek-v2", "mixtral", "qwen2-moe",
                          "qwen3-moe", "deepseek-v3")
"""One tiny config per family beyond Llama, run through every combination (Gemma 3:
windowed and global layers in three KV cache groups; DeepSeek-V2: latent attention; the
mixtures of experts, DeepSeek-V3 with latent attention and grouped, biased routing)."""
REFUSED = {("gemma2", "cpu"): "does not soft-cap attention scores"}
"""Combinations a backend refuses by design, with the reason its error names."""
FAMILY_LAYOUTS = {
    "phi3-window": ("phi3", {"sliding_window": 16}, ("continuous", "paged", "cpu"), ("chunked", "contiguous", "sdpa")),
    "opt-postnorm": ("opt-postnorm", {}, ("continuous", "paged", "cpu"), ("chunked", "contiguous", "sdpa")),
    "opt-project": ("opt-project", {}, ("continuous", "paged", "cpu"), ("static", "contiguous", "naive")),
    "falcon-7b": ("falcon", {}, ("continuous", "paged", "cpu"), ("chunked", "contiguous", "sdpa"),
                  ("dynamic", "paged", "naive")),
    "falcon-sequential": ("falcon", {"multi_query": False, "parallel_attn": False, "bias": True},
                          ("continuous", "paged", "cpu"), ("chunked", "paged", "sdpa")),
    "falcon-new-one-norm": ("falcon-new", {"num_ln_in_parallel_attn": 1}, ("chunked", "paged", "cpu")),
    "gemma2": ("gemma2", {}, ("continuous", "paged", "sdpa"), ("chunked", "contiguous", "naive")),
    "gemma3": ("gemma3", {}, ("continuous", "paged", "cpu"), ("chunked", "paged", "sdpa")),
    "deepseek-v2": ("deepseek-v2", {}, ("continuous", "paged", "cpu"), ("chunked", "contiguous", "naive")),
    "deepseek-v2-qlora": ("deepseek-v2-qlora", {}, ("chunked", "paged", "sdpa")),
    "deepseek-v2-moe": ("deepseek-v2-moe", {}, ("continuous", "paged", "cpu"), ("chunked", "contiguous", "sdpa")),
    "deepseek-v2-yarn": ("deepseek-v2", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}}, ("continuous", "paged", "sdpa")),
}
"""Other layouts of those families, Gemma 2 and 3 (windowed and global layers; Gemma 2's
soft cap, which attention=cpu refuses) and DeepSeek-V2's latent attention (queries straight
or through q_lora_rank; yarn, whose mscale_all_dim scales the softmax): (family, config
overrides, combinations)."""


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Folders of the families' representatives and of their other layouts."""
    from servelab.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp("families")
    folders = {family: tiny_checkpoint(root / family, family) for family in FAMILY_REPRESENTATIVES}
    for name, (family, overrides, *_) in FAMILY_LAYOUTS.items():
        folders[name] = tiny_checkpoint(root / name, family, **overrides)
    return folders


@pytest.mark.parametrize("family", FAMILY_REPRESENTATIVES)
@pytest.mark.parametrize("scheduler,cache,attention", COMBINATIONS)
def test_every_family_matches_transformers(family_checkpoints, family, scheduler, cache, attention):
    """Phi-3 (fused checkpoint projections, partial rotary, longrope), OPT (pre-norm),
    Falcon (new_decoder_architecture), Gemma 2 and 3, DeepSeek-V2, Mixtral, Qwen2-MoE,
    Qwen3-MoE and DeepSeek-V3 through every combination; a refused one names why."""
    if (family, attention) in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[family, attention]):
            LLM(family_checkpoints[family], overrides=[f"attention={attention}"])
        return
    assert_engine_matches_transformers(
        family_checkpoints[family], [f"scheduler={scheduler}", f"cache={cache}", f"attention={attention}",
                                     "cache.memory_bytes=4000000"])


@pytest.mark.parametrize("layout, combination", [(name, combination) for name, (_, _, *combinations)
                                                 in FAMILY_LAYOUTS.items() for combination in combinations])
def test_family_layouts_match_transformers(family_checkpoints, layout, combination):
    """Each other layout on a few combinations (prefill, chunked prefill, decode, both caches)."""
    scheduler, cache, attention = combination
    overrides = [f"scheduler={scheduler}", f"cache={cache}", f"attention={attention}", "cache.memory_bytes=4000000"]
    if scheduler == "chunked":
        overrides.append("scheduler.token_budget=16")
    assert_engine_matches_transformers(family_checkpoints[layout], overrides, max_tokens=20)
