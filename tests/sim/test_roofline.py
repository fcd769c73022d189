"""cost_model=roofline: the arithmetic of a known step on a tiny shape, tensor and pipeline
parallelism, attention from the real contexts, and clear errors."""

from __future__ import annotations

import pytest

from servelab import ConfigError
from servelab.core.config import HardwareConfig, ParallelConfig
from servelab.core.cost_model import BatchShape, CostModelContext
from servelab.core.model import ModelShape
from servelab.core.quantization import WeightQuantization, weight_memory_bytes
from servelab.plugins.cost_model.collectives import all_reduce_time, stage_layer_counts
from servelab.plugins.cost_model.operators import (Widths, attended_keys, attention_operators, last_stage_operators,
                                                   layer_operators)
from servelab.plugins.cost_model.roofline import RooflineCostModel, RooflineCostModelConfig

# hidden 32, 4 query heads and 2 KV heads of 8, MLP 64, 4 layers, vocabulary 100
SHAPE = ModelShape(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=None, max_positions=256,
                   vocab_size=100, hidden_size=32, intermediate_size=64)
# round numbers, no efficiency loss: 1 TFLOP/s, 1 GB/s
HW = HardwareConfig(name="test", peak_flops=1e12, memory_bandwidth=1e9, interconnect_bandwidth=1e8,
                    interconnect_latency_s=1e-5, devices_per_node=8, compute_efficiency=1.0, memory_efficiency=1.0,
                    interconnect_efficiency=1.0)
NO_OVERHEAD = RooflineCostModelConfig(kernel_overhead_s=0.0)


def model(tp: int = 1, pp: int = 1, config: RooflineCostModelConfig = NO_OVERHEAD, hw: HardwareConfig = HW,
          shape: ModelShape = SHAPE) -> RooflineCostModel:
    return RooflineCostModel(config, CostModelContext(shape, hw, ParallelConfig(tp, pp), 2.0, 2.0, 2.0))


def by_name(times) -> dict[str, float]:
    return dict(times)


def test_a_layers_operators_count_known_flops_and_bytes():
    ops = {op.name: op for op in layer_operators(4, Widths.of(SHAPE, 1, 2.0, 2.0, 2.0))}
    qkv = (4 + 2 * 2) * 8  # 64 columns
    assert ops["attn_pre_proj"].flops == 2 * 4 * 32 * qkv
    assert ops["attn_pre_proj"].bytes == 32 * qkv * 2 + 4 * (32 + qkv) * 2
    assert ops["mlp_up_proj"].flops == 2 * 4 * 32 * 128
    assert ops["mlp_down_proj"].bytes == 64 * 32 * 2 + 4 * (64 + 32) * 2
    assert ops["add"].bytes == 4 * 32 * 3 * 2  # two reads, one write


def test_quantized_weights_are_read_at_their_stored_width():
    float_ops = {op.name: op for op in layer_operators(4, Widths.of(SHAPE, 1, 2.0, 2.0, 2.0))}
    int8 = {op.name: op for op in layer_operators(4, Widths.of(SHAPE, 1, 2.0, 2.0, 2.0, WeightQuantization(8, -1)))}
    int4 = {op.name: op for op in layer_operators(4, Widths.of(SHAPE, 1, 2.0, 2.0, 2.0, WeightQuantization(4, 16)))}
    qkv = (4 + 2 * 2) * 8
    activations = 4 * (32 + qkv) * 2
    # int8: one byte per weight and one 2-byte scale per output channel
    assert int8["attn_pre_proj"].bytes == 32 * qkv * 1 + qkv * 2 + activations
    # int4: half a byte per weight, a 2-byte scale and zero per group of 16 inputs
    assert int4["attn_pre_proj"].bytes == 32 * qkv * 0.5 + qkv * (32 // 16) * 2 * 2 + activations
    assert int8["attn_pre_proj"].flops == float_ops["attn_pre_proj"].flops
    assert int8["input_layernorm"] == float_ops["input_layernorm"], "norm weights stay in floating point"
    assert int4["mlp_down_proj"].bytes == 64 * 32 * 0.5 + 32 * (64 // 16) * 2 * 2 + 4 * (64 + 32) * 2


def test_an_int8_lm_head_is_read_and_kept_beside_its_float_weight():
    float_head = {op.name: op for op in last_stage_operators(1, 1, Widths.of(SHAPE, 1, 2.0, 2.0, 2.0))}
    int8_head = {op.name: op for op in last_stage_operators(1, 1, Widths.of(
        SHAPE, 1, 2.0, 2.0, 2.0, WeightQuantization(8, -1, lm_head=True)))}
    assert float_head["lm_head"].bytes - int8_head["lm_head"].bytes == 32 * 100 * 2 - (32 * 100 + 100 * 2)
    body = weight_memory_bytes(SHAPE, WeightQuantization(8, -1), 2.0)
    assert weight_memory_bytes(SHAPE, WeightQuantization(8, -1, lm_head=True), 2.0) == body + 32 * 100 + 100 * 2
    assert body < weight_memory_bytes(SHAPE, None, 2.0)


def test_an_int4_lm_head_reads_its_nibbles_and_group_scales():
    int4 = WeightQuantization(4, 16, lm_head=True, lm_head_bits=4)
    head = {op.name: op for op in last_stage_operators(1, 1, Widths.of(SHAPE, 1, 2.0, 2.0, 2.0, int4))}["lm_head"]
    float_head = {op.name: op for op in last_stage_operators(1, 1, Widths.of(SHAPE, 1, 2.0, 2.0, 2.0))}["lm_head"]
    # 100 x 32 weights: half a byte each, a 2-byte scale and zero per group of 16 inputs
    assert float_head.bytes - head.bytes == 32 * 100 * 2 - (32 * 100 * 0.5 + 100 * (32 // 16) * 2 * 2)
    body = weight_memory_bytes(SHAPE, WeightQuantization(4, 16), 2.0)
    assert weight_memory_bytes(SHAPE, int4, 2.0) == body + 32 * 100 * 0.5 + 100 * (32 // 16) * 2 * 2


def test_memory_bound_decode_speeds_up_with_quantized_weights():
    llama = ModelShape(32, 32, 32, 128, None, 4096, 32000, 4096, 11008)
    a100 = HardwareConfig(name="a100-80gb", peak_flops=312e12, memory_bandwidth=2039e9)
    decode = BatchShape((1,), (128,), 1)
    times = {bits: RooflineCostModel(NO_OVERHEAD, CostModelContext(
        llama, a100, ParallelConfig(1, 1), 2.0, 2.0, 2.0,
        WeightQuantization(bits, 128) if bits else None)).forward_cost(decode).total for bits in (0, 8, 4)}
    # the decoder's linear weights are 6.5 of the 6.7B parameters, the float16 embedding and
    # LM head the rest: a bandwidth-bound step reads a bit more than half the bytes at int8
    assert 1.85 < times[0] / times[8] < 2.0
    assert 3.2 < times[0] / times[4] < 3.6


def test_operator_time_is_the_slower_roof_plus_the_kernel_overhead():
    cm = model(config=RooflineCostModelConfig(kernel_overhead_s=1e-6))
    ops = {op.name: op for op in layer_operators(4, cm.widths)}
    up = ops["mlp_up_proj"]
    assert cm.operator_time(up) == pytest.approx(max(up.flops / 1e12, up.bytes / 1e9) + 1e-6)
    # a memory-bound decode step: 1 token, the weights dominate
    assert up.bytes / 1e9 > up.flops / 1e12


def test_the_step_total_adds_every_layer_and_both_ends():
    cm = model()
    batch = BatchShape((4,), (4,), 1)
    cost = cm.forward_cost(batch)
    layer = sum(t for _, t in cm.layer_times(batch))
    ends = sum(t for _, t in cm.first_stage_times(4)) + sum(t for _, t in cm.last_stage_times(4, 1))
    assert cost.stage_times == pytest.approx((4 * layer + ends,))
    assert cost.total == pytest.approx(sum(t for _, t in cost.breakdown))
    names = {name for name, _ in cost.breakdown}
    assert {"emb", "attn_pre_proj", "attn_prefill", "lm_head", "sampling"} <= names


def test_attention_is_priced_from_the_real_context():
    w = Widths.of(SHAPE, 1, 2.0, 2.0, 2.0)
    kv_row = 2 * 2 * 8 * 2  # K and V of 2 heads of 8, 2 bytes each
    short, long = (attention_operators(BatchShape((1,), (c,), 1), w, None)[0] for c in (10, 110))
    assert short.name == "attn_decode" and long.bytes - short.bytes == 100 * kv_row
    assert long.flops == 4 * 4 * 8 * 110  # one query over 110 keys, 4 heads of 8
    # causal prefill: 4 new tokens after 6 cached see 7, 8, 9, 10 keys
    assert attended_keys(4, 10, None) == 7 + 8 + 9 + 10
    chunk = attention_operators(BatchShape((4,), (10,), 1), w, None)[0]
    assert chunk.name == "attn_prefill" and chunk.flops == 4 * 4 * 8 * 34
    mixed = {op.name for op in attention_operators(BatchShape((1, 4), (10, 10), 2), w, None)}
    assert mixed == {"attn_prefill", "attn_decode"}


def test_a_sliding_window_caps_the_keys():
    assert attended_keys(1, 100, 16) == 16
    assert attended_keys(4, 4, 2) == 1 + 2 + 2 + 2
    assert attended_keys(3, 10, 100) == attended_keys(3, 10, None)


def test_a_windowed_layer_reads_the_window_and_a_global_layer_the_whole_context():
    from dataclasses import replace

    # 4 layers: two windowed (16 keys), two global, as Gemma interleaves them
    gemma_like = replace(SHAPE, sliding_window=16, layer_windows=(16, None, 16, None))
    cm = model(shape=gemma_like, pp=2)
    decode = BatchShape((1,), (100,), 1)
    kv_row, q_row = 2 * 2 * 8 * 2, 2 * 4 * 8 * 2
    windowed, whole = (dict((op.name, op) for op in attention_operators(decode, cm.widths, window))["attn_decode"]
                       for window in (16, None))
    assert windowed.bytes == 16 * kv_row + kv_row + q_row and windowed.flops == 4 * 4 * 8 * 16
    assert whole.bytes == 100 * kv_row + kv_row + q_row and whole.flops == 4 * 4 * 8 * 100
    assert by_name(cm.layer_times(decode, 0))["attn_decode"] == cm.operator_time(windowed)
    assert by_name(cm.layer_times(decode, 1))["attn_decode"] == cm.operator_time(whole)
    cost = cm.forward_cost(decode)
    assert by_name(cost.breakdown)["attn_decode"] == pytest.approx(2 * cm.operator_time(windowed)
                                                                   + 2 * cm.operator_time(whole))
    assert cost.stage_times[0] == pytest.approx(cost.stage_times[1] - sum(t for _, t in cm.last_stage_times(1, 1))
                                                + sum(t for _, t in cm.first_stage_times(1)))
    every_layer_windowed = model(shape=replace(gemma_like, layer_windows=()), pp=2).forward_cost(decode)
    no_window = model(shape=replace(gemma_like, sliding_window=None, layer_windows=()), pp=2).forward_cost(decode)
    assert every_layer_windowed.total < cost.total < no_window.total


def test_a_latent_layer_caches_its_latent_and_reads_it_once_for_every_head():
    import torch

    from servelab.core.model import LatentAttention

    mla = LatentAttention(kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    shape = ModelShape(num_layers=4, num_heads=4, num_kv_heads=4, head_dim=12, sliding_window=None,
                       max_positions=256, vocab_size=100, hidden_size=32, intermediate_size=64, latent=mla)
    for tp in (1, 2):  # stored once, whole on every rank, as one KV head whose values are its keys
        assert shape.kv_cache_spec(torch.bfloat16, 256, tp).bytes_per_token == 4 * (32 + 4) * 2
    assert set(shape.linear_shapes()) >= {"self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj"}
    assert shape.linear_shapes()["self_attn.kv_b_proj"] == (4 * (8 + 8), 32)
    w = Widths.of(shape, 1, 2.0, 2.0, 2.0)
    (decode,) = attention_operators(BatchShape((1,), (100,), 1), w, None)
    # one latent of 32 and one rotary key of 4 per cached token for all four heads; per
    # head and pair 32 + 4 multiply-adds for the score and 32 for the value
    assert decode.bytes == 100 * 36 * 2 + 36 * 2 + 4 * (36 + 32) * 2
    assert decode.flops == 2 * 4 * (36 + 32) * 100
    assert model(shape=shape).forward_cost(BatchShape((1,), (100,), 1)).total > 0


def test_tensor_parallel_halves_the_compute_and_adds_two_all_reduces():
    batch = BatchShape((64,), (64,), 1)
    one, two = model(tp=1), model(tp=2)
    dense1, dense2 = by_name(one.dense_times(64)), by_name(two.dense_times(64))
    ops1 = {op.name: op for op in layer_operators(64, one.widths)}
    ops2 = {op.name: op for op in layer_operators(64, two.widths)}
    for name in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"):
        assert ops2[name].flops == ops1[name].flops / 2
        assert dense2[name] < dense1[name]
    layer = by_name(two.layer_times(batch))
    message = 64 * 32 * 2
    assert layer["all_reduce"] == pytest.approx(2 * (1e-5 + message / 1e8))  # 2 (n-1)/n = 1 for n = 2
    assert "all_reduce" not in by_name(one.layer_times(batch))


def test_all_reduce_beyond_a_node_uses_the_network():
    inside = all_reduce_time(1e6, 8, HW)
    across = HardwareConfig(**{**HW.__dict__, "devices_per_node": 4, "network_bandwidth": 1e7})
    assert all_reduce_time(1e6, 8, across) == pytest.approx(1e-5 + 2 * 7 / 8 * 1e6 / 4e7)
    assert all_reduce_time(1e6, 8, across) > inside
    assert all_reduce_time(1e6, 1, HW) == 0.0


def test_pipeline_stages_split_the_layers_and_send_activations():
    batch = BatchShape((8,), (8,), 1)
    whole, split = model(pp=1).forward_cost(batch), model(pp=2).forward_cost(batch)
    assert len(split.stage_times) == 2
    first_only = sum(t for _, t in model(pp=2).first_stage_times(8))
    last_only = sum(t for _, t in model(pp=2).last_stage_times(8, 1))
    assert split.stage_times[0] - first_only == pytest.approx(split.stage_times[1] - last_only)
    assert sum(split.stage_times) == pytest.approx(whole.total)
    assert split.transfer_time == pytest.approx(1e-5 + 8 * 32 * 2 / 1e8)
    assert stage_layer_counts(10, 4) == [3, 3, 2, 2]


def test_overheads_add_per_layer_and_per_step():
    batch = BatchShape((1,), (5,), 1)
    base = model().forward_cost(batch).total
    more = model(config=RooflineCostModelConfig(kernel_overhead_s=0.0, layer_overhead_s=1e-3,
                                                step_overhead_s=5e-3)).forward_cost(batch).total
    assert more - base == pytest.approx(4 * 1e-3 + 5e-3)


def test_bad_settings_name_the_field():
    with pytest.raises(ConfigError) as info:
        model(config=RooflineCostModelConfig(kernel_overhead_s=-1.0),
              hw=HardwareConfig(**{**HW.__dict__, "memory_efficiency": 1.5}))
    text = str(info.value)
    assert "cost_model.kernel_overhead_s" in text and "hardware.memory_efficiency" in text
    with pytest.raises(ConfigError, match="hidden_size"):
        model(shape=ModelShape(2, 4, 2, 8, None, 64, 100))
