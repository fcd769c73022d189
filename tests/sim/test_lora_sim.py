"""LoRA adapters in simulation: the roofline's low-rank matmuls (each adapter's weights
read once per step), loads over the host link and merges; executor=simulated paging
shape-only adapters through the model executor's slot table, batched against merged."""

from __future__ import annotations

import pytest

from servelab import LLM, ConfigError, SamplingParams
from servelab.core.config import HardwareConfig, ParallelConfig
from servelab.core.cost_model import AdapterWork, BatchShape, CostModelContext
from servelab.core.model import ModelShape
from servelab.plugins.cost_model.roofline import RooflineCostModel, RooflineCostModelConfig
from servelab.plugins.executor.simulated_lora import register_shape_only
from servelab.testing.oracle import assert_no_leaked_blocks

# hidden 32, 4 query heads and 2 KV heads of 8, MLP 64, 4 layers
SHAPE = ModelShape(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=None, max_positions=256,
                   vocab_size=100, hidden_size=32, intermediate_size=64)
HW = HardwareConfig(name="test", peak_flops=1e12, memory_bandwidth=1e9, interconnect_bandwidth=1e8,
                    interconnect_latency_s=1e-5, devices_per_node=8, compute_efficiency=1.0, memory_efficiency=1.0,
                    interconnect_efficiency=1.0, host_bandwidth=1e8)
ROOFLINE = RooflineCostModel(RooflineCostModelConfig(kernel_overhead_s=0.0),
                             CostModelContext(SHAPE, HW, ParallelConfig(1, 1), 2.0, 2.0, 2.0))
QV = ("q_proj", "v_proj")


def lora_part(adapters: tuple[AdapterWork, ...], tokens: int = 4) -> dict[str, float]:
    batch = BatchShape((1,) * tokens, (8,) * tokens, tokens, adapters=adapters)
    return {name: seconds for name, seconds in ROOFLINE.forward_cost(batch).breakdown if name.startswith("lora")}


def test_adapters_add_low_rank_matmuls_reading_each_adapters_weights_once():
    assert lora_part(()) == {}
    one = lora_part((AdapterWork(4, 8, QV),))
    # q: 32 -> 32, v: 32 -> 16 features; shrink reads A (8 x 32 each) once, x, writes x A^T
    shrink_bytes = 2 * (8 * 32 + 4 * 32 + 4 * 8) * 2.0
    assert one["lora_shrink"] == pytest.approx(SHAPE.num_layers * shrink_bytes / 1e9)
    split = lora_part((AdapterWork(2, 8, QV), AdapterWork(2, 8, QV)))
    assert split["lora_shrink"] > one["lora_shrink"]  # two adapters' weights read for the same tokens
    assert lora_part((AdapterWork(4, 16, QV),))["lora_expand"] > one["lora_expand"]


def test_loads_cross_the_host_link_and_merges_rewrite_the_base_weights():
    per_layer = 8 * ((32 + 32) + (32 + 16)) * 2.0  # A and B of q and v at rank 8
    assert ROOFLINE.adapter_load_time(8, QV) == pytest.approx(SHAPE.num_layers * per_layer / 1e8)
    merge = ROOFLINE.adapter_merge_time(8, QV)
    assert merge >= SHAPE.num_layers * 2 * (32 * 32 + 32 * 16) * 2.0 / 1e9
    with pytest.raises(ValueError, match="gate_proj"):
        RooflineCostModel(RooflineCostModelConfig(), CostModelContext(
            ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=None, max_positions=64,
                       vocab_size=100, hidden_size=32, intermediate_size=64, mlp_kind="plain"),
            HW, ParallelConfig(1, 1))).adapter_load_time(8, ("gate_proj",))


def serve(serving: str) -> LLM:
    llm = LLM("toy", overrides=["executor=simulated", "cost_model=roofline", "model.max_model_len=128",
                                "lora.enabled=true", "lora.max_rank=16", "lora.max_adapters=4",
                                f"executor.lora_serving={serving}", "scheduler.max_num_seqs=8"])
    names = [f"adapter{i}" for i in range(4)]
    register_shape_only(llm.engine, names, [8, 16], ["q_proj", "v_proj"])
    outputs = llm.generate([[1, 2, 3, 4, 5]] * 8, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False,
                           lora=[names[i % 4] for i in range(8)])
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert_no_leaked_blocks(llm)
    return llm


def test_batched_serving_pages_adapters_once_and_beats_merging_one_at_a_time():
    batched, merged = serve("batched"), serve("merged")
    stats = batched.engine.executor.lora_stats()
    assert stats.misses == 4 and stats.hits > 0 and stats.load_seconds > 0 and stats.split_steps == 0
    assert merged.engine.executor.lora_stats().misses >= 4
    assert merged.engine.clock.now() > 1.5 * batched.engine.clock.now()
    executor = batched.engine.executor  # the slots' memory is the KV cache's no longer
    spec = executor.context.shape.kv_cache_spec(executor.context.dtype, executor.context.max_model_len)
    with_slots = executor.kv_cache_budget_bytes(spec)
    slots, executor.lora = executor.lora, None
    assert executor.kv_cache_budget_bytes(spec) - with_slots == slots.num_slots * slots.slot_bytes > 0


def test_bad_adapter_settings_are_refused_naming_the_field():
    llm = LLM("toy", overrides=["executor=simulated", "cost_model=roofline", "model.max_model_len=128",
                                "lora.enabled=true", "lora.max_rank=8"])
    with pytest.raises(ConfigError, match="lora.max_rank"):
        register_shape_only(llm.engine, ["a"], [16], ["q_proj"])
    with pytest.raises(ConfigError, match="workload.adapter_projections"):
        register_shape_only(llm.engine, ["a"], [8], ["lm_head"])
    with pytest.raises(ConfigError, match="executor.lora_serving"):
        LLM("toy", overrides=["executor=simulated", "cost_model=roofline", "lora.enabled=true",
                              "executor.lora_serving=sometimes"])
