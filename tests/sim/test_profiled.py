"""cost_model=profiled: the table format and its interpolation, the shipped Vidur tables,
step tables, and refusing what no table covers."""

from __future__ import annotations

import json

import pytest

from servelab import ConfigError
from servelab.core.config import HardwareConfig, ParallelConfig
from servelab.core.cost_model import BatchShape, CostModelContext
from servelab.core.model import ModelShape
from servelab.core.quantization import WeightQuantization
from servelab.plugins.cost_model.operators import LINEAR_OPERATORS, attended_keys
from servelab.plugins.cost_model.roofline import RooflineCostModel, RooflineCostModelConfig
from servelab.plugins.cost_model.profiled import ProfiledCostModel, ProfiledCostModelConfig
from servelab.plugins.cost_model.step_table import (SCALARS, StepTableModel, build_step_series, fit_step_model,
                                                    padded_tokens, step_features)
from servelab.plugins.cost_model.table import CostTable, Series, load_table, save_table, shipped_tables

LLAMA_2_7B = ModelShape(32, 32, 32, 128, None, 4096, 32000, 4096, 11008)
LLAMA_2_70B = ModelShape(80, 64, 8, 128, None, 4096, 32000, 8192, 28672)
A100 = HardwareConfig(name="a100-80gb", peak_flops=312e12, memory_bandwidth=2039e9, interconnect_bandwidth=300e9,
                      interconnect_latency_s=49e-6, devices_per_node=8)
TINY = ModelShape(2, 4, 2, 8, None, 64, 100, 32, 64)


def context(shape=LLAMA_2_7B, hw=A100, tp=1, pp=1, element_bytes=2.0) -> CostModelContext:
    return CostModelContext(shape, hw, ParallelConfig(tp, pp), element_bytes, element_bytes, element_bytes)


def test_series_interpolates_exactly_at_and_linearly_between_grid_points():
    line = Series("t", ("num_tokens",), ((1.0, 3.0, 5.0),), [10.0, 30.0, 40.0])
    assert [line.at(x) for x in (1, 3, 5)] == [10.0, 30.0, 40.0]
    assert line.at(2) == pytest.approx(20.0) and line.at(4) == pytest.approx(35.0)
    assert line.at(0) == 10.0  # below the grid: the first value
    assert line.at(7) == pytest.approx(40.0 + 2 * (40.0 - 30.0) / 2)  # from the point nearest half the last one
    flat = Series("t", ("x",), ((1.0, 2.0),), [5.0, 4.0])
    assert flat.at(10) == 4.0  # never extended downwards
    plane = Series("t", ("b", "c"), ((1.0, 3.0), (10.0, 20.0)), [[1.0, 2.0], [3.0, 6.0]])
    assert plane.at(3, 20) == 6.0 and plane.at(2, 15) == pytest.approx((1.5 + 4.5) / 2)
    assert Series("k", (), (), 2.5).at() == 2.5


def test_series_rejects_a_bad_grid():
    with pytest.raises(ConfigError, match="increasing"):
        Series("t", ("x",), ((2.0, 1.0),), [1.0, 2.0])
    with pytest.raises(ConfigError, match="nested like the grid"):
        Series("t", ("x",), ((1.0, 2.0),), [1.0])


def test_a_table_survives_saving_and_loading(tmp_path):
    table = CostTable("operators", ("a100-80gb",), (Series("add", ("num_tokens",), ((1.0, 2.0),), [1e-6, 2e-6],
                                                           {"tensor_parallel_size": 1}),),
                      {"hidden_size": 32}, "float16", {"source": "test"})
    loaded = load_table(save_table(table, tmp_path / "t.json"))
    assert loaded.find("add", tensor_parallel_size=1).at(1.5) == pytest.approx(1.5e-6)
    assert loaded.find("add", tensor_parallel_size=2) is None
    assert loaded.model == {"hidden_size": 32} and loaded.meta["source"] == "test"


def test_the_loader_names_the_file_and_the_problem(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ConfigError, match="bad.json.*format"):
        load_table(bad)
    bad.write_text(json.dumps({"format": "servelab-cost-table", "version": 1, "kind": "x", "hardware": [],
                               "series": []}))
    with pytest.raises(ConfigError) as info:
        load_table(bad)
    assert "kind 'x'" in str(info.value) and "'hardware'" in str(info.value) and "'series'" in str(info.value)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_table(tmp_path / "missing.json")


def test_the_shipped_tables_load():
    names = {p.name for p in shipped_tables()}
    assert {"vidur-a100-llama-2-7b.json", "vidur-h100-llama-2-70b.json", "vidur-a100-dgx-all-reduce.json"} <= names
    assert (shipped_tables()[0].parent / "LICENSE-vidur").exists()


def test_operator_tables_are_read_at_their_grid_points():
    table = load_table(next(p for p in shipped_tables() if p.name == "vidur-a100-llama-2-7b.json"))
    cm = ProfiledCostModel(ProfiledCostModelConfig(), context(tp=2))
    assert cm.table.path == table.path
    dense = dict(cm.dense_times(512))
    for name in ("attn_pre_proj", "mlp_up_proj", "add"):
        assert dense[name] == table.find(name, tensor_parallel_size=2).at(512)
    # attention is not in the table: the roofline prices it from the context
    short = dict(cm.layer_times(BatchShape((1,), (100,), 1)))["attn_decode"]
    long = dict(cm.layer_times(BatchShape((1,), (4000,), 1)))["attn_decode"]
    assert long > short > 0
    # the DGX all-reduce table prices TP 2 inside a node
    allreduce = load_table(next(p for p in shipped_tables() if p.name == "vidur-a100-dgx-all-reduce.json"))
    series = allreduce.find("all_reduce", num_devices=2, devices_per_node=2)
    assert cm.all_reduce(series.grid[0][3]) == series.seconds[3]


def test_what_no_table_covers_is_refused_clearly():
    mistral = ModelShape(32, 32, 8, 128, 4096, 32768, 32000, 4096, 14336)
    with pytest.raises(ConfigError) as info:
        ProfiledCostModel(ProfiledCostModelConfig(), context(shape=mistral))
    text = str(info.value)
    assert "no table" in text and "intermediate_size 14336 (table: 11008)" in text and "mode=profile" in text
    with pytest.raises(ConfigError, match="tensor parallelism 1, 2, 4, 8, not parallel.tensor_parallel_size=16"):
        ProfiledCostModel(ProfiledCostModelConfig(table="vidur-a100-llama-2-70b"), context(LLAMA_2_70B, tp=16))
    with pytest.raises(ConfigError, match="4-byte weights"):
        ProfiledCostModel(ProfiledCostModelConfig(table="vidur-a100-llama-2-7b"), context(element_bytes=4.0))
    l40s = HardwareConfig(name="l40s", peak_flops=362e12, memory_bandwidth=864e9)
    with pytest.raises(ConfigError, match="hardware=l40s"):
        ProfiledCostModel(ProfiledCostModelConfig(), context(hw=l40s))
    with pytest.raises(ConfigError, match="neither a file nor a shipped table"):
        ProfiledCostModel(ProfiledCostModelConfig(table="nope"), context())


def test_quantized_linear_layers_leave_the_float_tables_for_the_roofline():
    table = ProfiledCostModel(ProfiledCostModelConfig(table="vidur-a100-llama-2-7b"), context())
    int8_context = CostModelContext(LLAMA_2_7B, A100, ParallelConfig(1, 1), 2.0, 2.0, 2.0, WeightQuantization(8, -1))
    int8 = dict(ProfiledCostModel(ProfiledCostModelConfig(table="vidur-a100-llama-2-7b"), int8_context)
                .dense_times(1))
    roofline = dict(RooflineCostModel(RooflineCostModelConfig(), int8_context).dense_times(1))
    measured = dict(table.dense_times(1))
    for name in LINEAR_OPERATORS:
        assert int8[name] == roofline[name] and int8[name] != measured[name], name
    assert int8["input_layernorm"] == measured["input_layernorm"]


def test_a_step_table_covers_the_quantization_it_was_measured_with(tmp_path):
    series = build_step_series([1, 64], [1e-3, 2e-3], dict.fromkeys(SCALARS, 0.0), [1, 8], [1e-4, 2e-4])
    model = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
             "intermediate_size": 64, "vocab_size": 100, "tied_embeddings": False}
    path = tmp_path / "steps.json"
    save_table(CostTable("steps", ("a100-80gb",), series, model, "float16", {"engine": {"quantization": "int8"}}),
               path)
    int8 = CostModelContext(TINY, A100, ParallelConfig(1, 1), 2.0, 2.0, 2.0, WeightQuantization(8, -1))
    ProfiledCostModel(ProfiledCostModelConfig(table=str(path), jitter=False), int8)
    with pytest.raises(ConfigError, match="measured with model.quantization=int8, the model runs with "
                                          "model.quantization=none"):
        ProfiledCostModel(ProfiledCostModelConfig(table=str(path), jitter=False), context(TINY))


def test_the_step_model_fit_recovers_known_terms():
    grid, buckets = [1, 8, 32, 64], [1, 2, 4, 8, 16, 32, 48, 64]
    truth = {"linear": {1: 1e-3, 8: 2e-3, 32: 5e-3, 64: 9e-3}, "attention_prefill_pair": 2e-7,
             "attention_decode_token": 3e-7, "request": 1e-4, "logits_row": 5e-5}

    def seconds(batch: BatchShape) -> float:
        tokens, pairs, context_tokens, requests, rows = step_features(batch, buckets)
        linear = Series("l", ("n",), (tuple(map(float, grid)),), [truth["linear"][g] for g in grid]).at(tokens)
        return (linear + pairs * truth["attention_prefill_pair"] + context_tokens * truth["attention_decode_token"]
                + requests * truth["request"] + rows * truth["logits_row"])

    batches = ([BatchShape((n,), (n,), 1) for n in grid] + [BatchShape((1,) * b, (c,) * b, b) for b in (2, 8, 32)
                                                            for c in (4, 60)]
               + [BatchShape((16,), (48,), 0), BatchShape((8, 8), (8, 40), 1), BatchShape((1, 1, 30), (9, 9, 30), 3)])
    linear, scalars = fit_step_model(batches, [seconds(b) for b in batches], grid, buckets)
    assert linear == pytest.approx([truth["linear"][g] for g in grid], rel=1e-6)
    for name in SCALARS:
        assert scalars[name] == pytest.approx(truth[name], rel=1e-6)
    assert padded_tokens(20, buckets) == 32 and padded_tokens(100, buckets) == 100


def test_step_features_average_the_layers_windows():
    decode_and_prefill = BatchShape((1, 4), (100, 40), 1)
    _, pairs, context_tokens, _, _ = step_features(decode_and_prefill, (), ((16, 3), (None, 1)))
    assert context_tokens == pytest.approx((3 * 16 + 100) / 4)
    assert pairs == pytest.approx((3 * attended_keys(4, 40, 16) + attended_keys(4, 40, None)) / 4)


def test_a_step_table_prices_whole_steps_with_the_engine_overhead(tmp_path):
    series = build_step_series([1, 64], [1e-3, 9e-3], {"attention_prefill_pair": 0.0, "attention_decode_token": 1e-6,
                                                       "request": 1e-4, "logits_row": 0.0}, [1, 8], [2e-4, 4e-4])
    table = CostTable("steps", ("local",), series, {"num_layers": 2, "hidden_size": 32, "vocab_size": 100},
                      "float32", {"row_buckets": []})
    path = save_table(table, tmp_path / "steps.json")
    cm = ProfiledCostModel(ProfiledCostModelConfig(table=str(path)),
                           context(TINY, HardwareConfig(name="local"), element_bytes=4.0))
    cost = cm.forward_cost(BatchShape((1, 1), (10, 30), 2))
    expected = (1e-3 + 1e-3 * 8 / 63) + 40 * 1e-6 + 2 * 1e-4 + (2e-4 + 2e-4 / 7)
    assert cost.total == pytest.approx(expected)
    assert dict(cost.breakdown)["engine_overhead"] == pytest.approx(2e-4 + 2e-4 / 7)
    assert StepTableModel.problems(table) == []
    with pytest.raises(ConfigError, match="measured on one device"):
        ProfiledCostModel(ProfiledCostModelConfig(table=str(path)),
                          context(TINY, HardwareConfig(name="local"), tp=2, element_bytes=4.0))
    with pytest.raises(ConfigError, match="num_layers 4 \\(table: 2\\)"):
        ProfiledCostModel(ProfiledCostModelConfig(table=str(path)),
                          context(ModelShape(4, 4, 2, 8, None, 64, 100, 32, 64), HardwareConfig(name="local"),
                                  element_bytes=4.0))


def test_a_step_table_with_dispersion_draws_each_step_seeded(tmp_path):
    series = build_step_series([1, 64], [1e-3, 9e-3], dict.fromkeys(SCALARS, 0.0), [1, 8], [0.0, 0.0])
    meta = {"row_buckets": [], "dispersion": {"step_time_over_median": [0.9, 1.0, 2.0]}}
    path = save_table(CostTable("steps", ("local",), series, {"num_layers": 2, "hidden_size": 32, "vocab_size": 100},
                                "float32", meta), tmp_path / "steps.json")
    ctx = context(TINY, HardwareConfig(name="local"), element_bytes=4.0)
    batch = BatchShape((1,), (10,), 1)

    def totals(**config):
        cm = ProfiledCostModel(ProfiledCostModelConfig(table=str(path), **config), ctx)
        return [cm.forward_cost(batch) for _ in range(200)]

    plain = totals(jitter=False)
    assert [c.total for c in plain] == [pytest.approx(1e-3)] * 200
    drawn = totals(seed=1)
    assert [c.total for c in drawn] == [c.total for c in totals(seed=1)] != [c.total for c in totals(seed=2)]
    assert all(0.9e-3 <= c.total <= 2e-3 + 1e-12 for c in drawn) and len({c.total for c in drawn}) == 200
    assert all(sum(s for _, s in c.breakdown) == pytest.approx(c.total) for c in drawn)
    meta["dispersion"]["persistence"] = [[1.0, 1.0]]
    drifting = save_table(CostTable("steps", ("local",), series, {"num_layers": 2, "hidden_size": 32,
                                                                  "vocab_size": 100}, "float32", meta),
                          tmp_path / "drifting.json")
    cm = ProfiledCostModel(ProfiledCostModelConfig(table=str(drifting), jitter_persistence=True), ctx)
    together = {cm.forward_cost(BatchShape((1,), (10,), 1, start_s=5.0)).total for _ in range(20)}
    apart = {cm.forward_cost(BatchShape((1,), (10,), 1, start_s=100.0 * i)).total for i in range(20)}
    assert len(together) == 1 and len(apart) == 20          # the drift follows the step's start time
    independent = ProfiledCostModel(ProfiledCostModelConfig(table=str(drifting)), ctx)   # the default
    assert len({independent.forward_cost(BatchShape((1,), (10,), 1, start_s=5.0)).total for _ in range(20)}) == 20
    meta["dispersion"]["step_time_over_median"] = [1.0, 0.5]
    bad = save_table(CostTable("steps", ("local",), series, {"num_layers": 2, "hidden_size": 32, "vocab_size": 100},
                               "float32", meta), tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="meta.dispersion"):
        ProfiledCostModel(ProfiledCostModelConfig(table=str(bad)), ctx)
