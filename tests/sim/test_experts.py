"""Mixtures of experts in the simulator: the distinct experts a step activates, skewed
routing, expert parallelism's all-to-alls, errors that name the field, and every MoE preset."""

from __future__ import annotations

from dataclasses import replace

import pytest

from servelab import ConfigError, SamplingParams
from servelab.core.config import HardwareConfig, ParallelConfig
from servelab.core.cost_model import BatchShape, CostModelContext
from servelab.core.engine.llm_engine import LLMEngine
from servelab.core.entrypoints.compose import compose_config
from servelab.core.model import MixtureOfExperts, ModelShape
from servelab.plugins.cost_model.experts import expected_active, pick_probabilities, sparse_mlp_operators
from servelab.plugins.cost_model.roofline import RooflineCostModel, RooflineCostModelConfig

MOE = MixtureOfExperts(num_experts=16, top_k=2, expert_intermediate_size=32)
# hidden 32, 4 layers, the first one dense (MLP 64), the others 2 of 16 experts of 32 and a shared one of 32
SHAPE = ModelShape(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=None, max_positions=256,
                   vocab_size=100, hidden_size=32, intermediate_size=64,
                   experts=replace(MOE, shared_intermediate_size=32, dense_layers=(0,)))
HW = HardwareConfig(name="test", peak_flops=1e12, memory_bandwidth=1e9, interconnect_bandwidth=1e8,
                    interconnect_latency_s=1e-5, devices_per_node=8, compute_efficiency=1.0, memory_efficiency=1.0,
                    interconnect_efficiency=1.0)


def roofline(tp: int = 1, ep: int = 1, shape: ModelShape = SHAPE) -> RooflineCostModel:
    return RooflineCostModel(RooflineCostModelConfig(kernel_overhead_s=0.0),
                             CostModelContext(shape, HW, ParallelConfig(tp, 1, expert_parallel_size=ep), 2.0, 2.0, 2.0))


def test_expected_distinct_experts_go_from_top_k_to_every_expert():
    assert expected_active(MOE, 1) == pytest.approx(2)
    assert expected_active(MOE, 10) == pytest.approx(16 * (1 - (1 - 2 / 16) ** 10))
    assert expected_active(MOE, 10_000) == pytest.approx(16)


def test_skewed_routing_activates_fewer_experts():
    skewed = replace(MOE, routing_skew=1.0)
    assert sum(pick_probabilities(skewed)) == pytest.approx(2) and max(pick_probabilities(skewed)) <= 1.0
    for tokens in (4, 16, 64):
        assert expected_active(skewed, tokens) < expected_active(MOE, tokens)


def test_a_sparse_layer_reads_only_the_experts_a_step_activates():
    cm = roofline()
    one = dict(cm.layer_times(BatchShape((1,), (8,), 1), 1))
    many = dict(cm.layer_times(BatchShape((512,), (512,), 1), 1))
    assert "mlp_up_proj" in dict(cm.layer_times(BatchShape((1,), (8,), 1), 0))  # the dense layer
    assert {"moe_router", "moe_shared_up_proj", "moe_up_proj", "moe_down_proj"} <= set(one) and "mlp_up_proj" not in one
    w = cm.widths
    for tokens, experts in ((1, 2), (512, 16)):  # one token reads 2 experts' gate and up weights, 512 tokens all 16
        up = {op.name: op for op in sparse_mlp_operators(tokens, w, SHAPE.experts, 1, 1)}["moe_up_proj"]
        pairs = 2 * tokens
        assert up.bytes == pytest.approx(experts * 32 * 64 * 2 + pairs * (32 + 64) * 2, rel=1e-3)
        assert up.flops == pytest.approx(2 * pairs * 32 * 64)
    assert many["moe_up_proj"] > one["moe_up_proj"]


def test_expert_parallel_all_to_all_adds_time_only_past_one_rank():
    batch = BatchShape((64,), (64,), 1)
    alone, split = roofline(tp=2, ep=1), roofline(tp=2, ep=2)
    assert "all_to_all" not in dict(alone.layer_times(batch, 1))
    layer = dict(split.layer_times(batch, 1))
    # each rank dispatches its 32 tokens' 2 copies of 32 bf16 features, half of them to the other rank, and combines
    assert layer["all_to_all"] == pytest.approx(2 * (1e-5 + 0.5 * 32 * 2 * 32 * 2 / 1e8))
    assert "all_to_all" not in dict(split.layer_times(batch, 0))  # the dense layer


def test_skew_makes_the_expert_parallel_step_wait_for_the_busiest_rank():
    batch = BatchShape((256,), (256,), 1)
    skewed = replace(SHAPE, experts=replace(SHAPE.experts, routing_skew=1.0))
    even, uneven = dict(roofline(2, 2).layer_times(batch, 1)), dict(roofline(2, 2, skewed).layer_times(batch, 1))
    assert uneven["moe_up_proj"] > even["moe_up_proj"]


@pytest.mark.parametrize("ep, message", [
    (3, r"parallel.expert_parallel_size=3 must divide the model's 8 routed experts"),
    (4, r"parallel.expert_parallel_size=4 must divide .* and be 1 or parallel.tensor_parallel_size=2"),
])
def test_a_bad_expert_parallel_size_names_the_field(ep, message):
    with pytest.raises(ConfigError, match=message):
        LLMEngine(compose_config(["model=mixtral-8x7b", "hardware=h100-80gb", "executor=simulated",
                                  "parallel.tensor_parallel_size=2", f"parallel.expert_parallel_size={ep}"]))


@pytest.mark.parametrize("overrides, message", [
    (["parallel.expert_dispatch=broadcast"], "parallel.expert_dispatch must be one of all_reduce, all_to_all, got "
                                             "'broadcast'"),
    (["parallel.expert_dispatch=all_to_all"], "parallel.expert_dispatch=all_to_all .* needs "
                                              "parallel.expert_parallel_size > 1"),
])
def test_a_bad_expert_dispatch_names_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        LLMEngine(compose_config(["model=mixtral-8x7b", "hardware=h100-80gb", "executor=simulated",
                                  "parallel.tensor_parallel_size=2", *overrides]))


@pytest.mark.parametrize("executor", ["simulated", "model"])
def test_expert_parallelism_needs_a_mixture_of_experts(executor):
    with pytest.raises(ConfigError, match="parallel.expert_parallel_size=2: the model's shape describes no mixture"):
        LLMEngine(compose_config(["model=toy", "device=cpu", f"executor={executor}", "parallel.expert_parallel_size=2"]))


PRESETS = {
    "mixtral-8x7b": (46.7, ["hardware=h100-80gb", "parallel.tensor_parallel_size=2",
                            "parallel.expert_parallel_size=2"]),
    "qwen3-30b-a3b": (30.5, ["hardware=h100-80gb"]),
    "qwen3-235b-a22b": (235.1, ["hardware=h200", "parallel.tensor_parallel_size=4"]),
    "deepseek-v3": (671.0, ["hardware=h200", "parallel.tensor_parallel_size=8", "parallel.expert_parallel_size=8",
                            "model.quantization=int8"]),
    "deepseek-v2-lite": (15.7, ["hardware=a100-80gb"]),
}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_moe_preset_builds_and_runs(preset):
    billions, overrides = PRESETS[preset]
    engine = LLMEngine(compose_config([f"model={preset}", "executor=simulated", "model.max_model_len=1024",
                                       *overrides]))
    assert engine.shape.experts is not None
    assert engine.shape.num_parameters / 1e9 == pytest.approx(billions, abs=0.05)
    for prompt in ([1] * 64, [2] * 200):
        engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    assert len(finished) == 2 and engine.clock.now() > 0


MIXTRAL = ["model=mixtral-8x7b", "executor=simulated", "hardware=h100-80gb", "model.max_model_len=1024",
           "parallel.tensor_parallel_size=2", "parallel.expert_parallel_size=2"]


def trace(tmp_path, pairs: list[int]) -> str:
    """A servelab-bench metrics.json whose measured run routed ``pairs`` per expert."""
    import json

    from servelab.core.expert_load import ExpertLoad

    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({"system": {"experts": ExpertLoad({0: tuple(pairs)}).summary()}}))
    return str(path)


def test_a_shape_read_through_its_implementation_keeps_the_routing_skew():
    engine = LLMEngine(compose_config([*MIXTRAL, "model.shape.experts.routing_skew=1.0"]))
    assert engine.shape.experts.routing_skew == 1.0 and engine.shape.experts.num_experts == 8


def test_a_routing_trace_sets_the_popularity_and_the_busiest_rank(tmp_path):
    """A real run's pairs per expert: here experts 4-7 drew 90%, so rank 1 holds the busiest
    experts and the step waits for it, longer than under even routing."""
    from servelab.plugins.cost_model.experts import busiest_experts

    engine = LLMEngine(compose_config([*MIXTRAL, f"model.shape.experts.routing_trace={trace(tmp_path, [5] * 4 + [45] * 4)}"]))
    moe = engine.shape.experts
    assert moe.popularity == pytest.approx((0.025,) * 4 + (0.225,) * 4)
    assert pick_probabilities(moe) == pytest.approx((0.05,) * 4 + (0.45,) * 4)
    assert busiest_experts(moe, 2) == range(4, 8)
    batch = BatchShape((256,), (256,), 1)
    traced = replace(SHAPE, experts=replace(SHAPE.experts, popularity=(0.01,) * 8 + (0.115,) * 8))
    even, uneven = dict(roofline(2, 2).layer_times(batch, 1)), dict(roofline(2, 2, traced).layer_times(batch, 1))
    assert uneven["moe_up_proj"] > even["moe_up_proj"]


@pytest.mark.parametrize("pairs, extra, message", [
    ([3] * 16, [], r"routing_trace=.* counts 16 experts, the shape routes to n_routed_experts=8"),
    ([0] * 8, [], r"routing_trace=.* holds no routed pairs"),
    ([1] * 8, ["model.shape.experts.routing_skew=0.5"], "routing_skew=0.5 and routing_trace both set"),
    (None, [], r"routing_trace=.*: no servelab-bench metrics.json with system.experts.pairs_per_expert"),
])
def test_a_routing_trace_that_cannot_be_used_names_the_field(tmp_path, pairs, extra, message):
    path = trace(tmp_path, pairs) if pairs is not None else str(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match=message):
        LLMEngine(compose_config([*MIXTRAL, f"model.shape.experts.routing_trace={path}", *extra]))
