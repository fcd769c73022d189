"""Hydra composition: every registered option builds; bad configs fail with clear messages."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from servelab import ConfigError, LLM
from servelab.core.entrypoints.compose import compose_config
from servelab.core.engine.registry import CONFIG_GROUPS, get_registry

REGISTRY = get_registry()
OPTIONS = [(group, name) for group in CONFIG_GROUPS for name in sorted(REGISTRY.specs(group))]
EXTRA = {("decoding", "speculative"): ["decoding.draft=toy"], ("decoding", "eagle"): ["model.max_model_len=256"]}
"""Options that need a setting to run: a draft sharing toy's vocabulary; tiny's context within the small cache."""
MODELS = {("decoding", "eagle"): "tiny"}
"""Options that run on another model than toy: an EAGLE head is trained for one target (tiny's is shipped)."""


@pytest.mark.parametrize("group,option", OPTIONS)
def test_every_registered_option_composes_and_builds(group, option, attention_env):
    if group == "attention":
        attention_env(option)
    llm = LLM(MODELS.get((group, option), "toy"),
              overrides=["device=cpu", "cache.memory_bytes=2000000", *EXTRA.get((group, option), [])],
              **{group: option})
    out = llm.generate([[1, 2, 3]], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1
    spec = REGISTRY.spec_for_config(group, llm.engine.cfg[group])
    assert spec.name == option or (option == "auto" and spec.name in ("cpu", "sdpa"))  # auto is a selector


def test_unknown_option_lists_the_available_ones():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["scheduler=nope"])
    message = str(info.value)
    assert "scheduler/nope" in message
    assert all(name in message for name in REGISTRY.specs("scheduler"))


def test_wrong_type_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["cache.block_size=abc"])
    assert "block_size" in str(info.value.__cause__) or "block_size" in str(info.value)


def test_unknown_key_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["cache.blocksize=8"])
    assert isinstance(info.value.__cause__, (ConfigKeyError, ValidationError)) or "blocksize" in str(info.value)


def test_cross_component_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        LLM("toy", overrides=["scheduler.max_num_batched_tokens=10", "cache.num_blocks=2", "cache.block_size=4",
                              "model.dtype=float32"])
    problems = info.value.problems
    assert any("max_num_batched_tokens=10" in p and "max_model_len=512" in p for p in problems)
    assert any("KV cache holds 8 tokens" in p for p in problems)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    from servelab.testing import tiny_checkpoint
    import json

    folder = tiny_checkpoint(tmp_path / "m", "llama")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        LLM(folder)
    assert "GPT2LMHeadModel" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def test_model_preset_and_folder_and_keyword_choices(llama):
    llm = LLM(llama, scheduler="static", cache="contiguous", overrides=["model.max_model_len=128"])
    cfg = llm.engine.cfg
    assert cfg.model.path.endswith("llama")
    assert REGISTRY.spec_for_config("scheduler", cfg.scheduler).name == "static"
    assert REGISTRY.spec_for_config("cache", cfg.cache).name == "contiguous"
    assert llm.engine.max_model_len == 128


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        LLM(overrides=["model=local", f"model.path={tmp_path}/absent"])
    assert "model.path" in str(info.value) and "config.json" in str(info.value)


def test_draft_with_another_vocabulary_is_refused():
    with pytest.raises(ConfigError) as info:
        LLM("toy", decoding="speculative", overrides=["decoding.draft=tiny-draft"])
    assert "vocabulary (4096) differs from the target's (257)" in str(info.value)
