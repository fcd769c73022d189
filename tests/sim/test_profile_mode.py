"""servelab-bench mode=profile: a tiny grid on model=toy writes a step table that
cost_model=profiled loads and simulates with."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from servelab import ConfigError, LLM
from servelab.bench.config import ProfileModeConfig, store_bench_schemas
from servelab.core.entrypoints.compose import compose_config
from servelab.plugins.cost_model.table import load_table

TINY_GRID = ["mode=profile", "mode.repeats=2", "mode.token_grid=[1,4,16,48]", "mode.batch_sizes=[1,3]",
             "mode.context_fractions=[0.0,1.0]", "mode.chunk_sizes=[8]", "mode.cached_fractions=[0.25]",
             "mode.prompt_counts=[2]", "mode.prompt_lengths=[8]", "mode.mixed_batch_sizes=[2]",
             "mode.holdout_steps=2", "mode.overhead_requests=3", "mode.overhead_rounds=1"]
SMALL_ENGINE = ["model=toy", "model.max_model_len=64", "scheduler.max_num_batched_tokens=64", "device=cpu",
                "cache.memory_bytes=2000000", "use_tqdm=false"]


def bench_config(*overrides: str):
    store_bench_schemas()
    return compose_config([*SMALL_ENGINE, *overrides], config_name="bench")


def test_profile_writes_a_table_the_profiled_model_simulates_with(tmp_path):
    from servelab.bench.profile import profile

    cfg = bench_config(*TINY_GRID, f"mode.out={tmp_path / 'copy.json'}")
    assert OmegaConf.get_type(cfg.mode) is ProfileModeConfig
    metrics = profile(cfg, tmp_path, "servelab-bench (test)")
    table = load_table(metrics["table"])
    assert table.kind == "steps" and table.hardware == ("local",) and table.dtype == "float32"
    assert table.model["num_layers"] == 2 and table.meta["command"] == "servelab-bench (test)"
    assert {"fit", "holdout"} == set(table.meta["fit"]) and table.meta["fit"]["holdout"]["points"] >= 1
    assert [s.name for s in table.series][0] == "linear" and table.find("engine_overhead") is not None
    assert load_table(tmp_path / "copy.json").series == table.series
    spread = table.meta["dispersion"]["step_time_over_median"]
    assert len(spread) == 101 and spread == sorted(spread) and spread[0] <= 1 <= spread[-1]
    persistence = table.meta["dispersion"]["persistence"]
    assert len(persistence) <= 2 and sum(share for share, _ in persistence) <= 1
    assert all(share > 0 and seconds > 0 for share, seconds in persistence) and metrics["persistence"] == persistence
    llm = LLM("toy", overrides=["executor=simulated", "cost_model=profiled", f"cost_model.table={metrics['table']}",
                                "model.max_model_len=64", "model.dtype=float32", "cache.memory_bytes=2000000"])
    out = llm.generate([[1, 2, 3]], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1 and llm.engine.clock.now() > 0
    with pytest.raises(ConfigError, match="model differs"):
        LLM("toy", overrides=["executor=simulated", "cost_model=profiled", f"cost_model.table={metrics['table']}",
                              "model.dtype=float32", "model.shape.num_hidden_layers=3", "cache.memory_bytes=2000000"])


def test_profile_needs_the_real_forward_pass(tmp_path):
    from servelab.bench.profile import profile

    with pytest.raises(ConfigError, match="executor=model"):
        profile(bench_config(*TINY_GRID, "executor=simulated"), tmp_path, "test")
