"""Weight quantization: the format's reference (quantize, dequantize, nibble packing), the
quantized linear layer's CPU kernels against dequantize-then-F.linear, the checkpoint
rewrite, and the start-up checks that name the field and the limit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from servelab.core.config import ModelConfig
from servelab.core.errors import ConfigError
from servelab.core.model import ModelShape
from servelab.core.quantization import WeightQuantization, quantization_problems, quantized_weights, resolve_quantization
from servelab.plugins.models.linear import Linear
from servelab.plugins.models.quantized_linear import (QuantizedHead, QuantizedLinear, pack_quantized_linears,
                                                     quantize_linears)
from servelab.kernels.quantized_weights import (dequantize_int4, dequantize_int8, pack_int4, quantize_int4,
                                                quantize_int8, unpack_int4)
from servelab.kernels.w4a8_cpu import w4a8_linear_reference
from servelab.kernels.w8a8_cpu import w8a8_linear_reference, w8a8_unavailable_reason

SHAPE = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=None, max_positions=64,
                   vocab_size=32, hidden_size=64, intermediate_size=192)


def test_nibbles_round_trip_low_nibble_first():
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 6) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)
    assert torch.equal(unpack_int4(packed), q)


def test_int8_error_is_at_most_half_a_step_per_row():
    torch.manual_seed(0)
    weight = torch.randn(48, 64) * torch.linspace(0.01, 3.0, 48)[:, None]
    qweight, scales = quantize_int8(weight)
    assert qweight.dtype == torch.int8 and scales.shape == (48,)
    error = (dequantize_int8(qweight, scales, torch.float32) - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-6).all()
    assert int(qweight.abs().max()) == 127


def test_int4_error_is_at_most_half_a_step_per_group_and_zero_rows_stay_zero():
    torch.manual_seed(0)
    weight = torch.randn(8, 128)
    weight[3] = 0.0
    qweight, scales, zeros = quantize_int4(weight, 32)
    assert qweight.shape == (8, 64) and scales.shape == zeros.shape == (8, 4)
    restored = dequantize_int4(qweight, scales, zeros, torch.float32)
    step = scales.repeat_interleave(32, dim=1)
    assert ((restored - weight).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(restored[3], torch.zeros(128))


def quantized_layer(bits: int, group_size: int, dtype: torch.dtype, bias: bool = True, seed: int = 0,
                    in_features: int = 256, out_features: int = 96,
                    int8_activations: bool = False) -> tuple[QuantizedLinear, torch.Tensor]:
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features) * 0.05
    layer = QuantizedLinear(in_features, out_features, bias, bits, group_size, dtype, int8_activations)
    tensors = dict(quantized_weights([("model.layers.0.mlp.down_proj.weight", weight)],
                                     WeightQuantization(bits, group_size)))
    with torch.no_grad():
        for name in ("qweight", "scales", "zeros"):
            key = f"model.layers.0.mlp.down_proj.{name}"
            if key in tensors:
                getattr(layer, name).copy_(tensors[key])
        if bias:
            layer.bias.copy_(torch.randn(out_features))
    return layer, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, group_size", [(8, -1), (4, 16), (4, 32), (4, 128), (4, 256)])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_cpu_kernel_equals_dequantized_reference(bits, group_size, dtype, rows):
    layer, _ = quantized_layer(bits, group_size, dtype)
    x = torch.randn(rows, 256).to(dtype)
    with torch.inference_mode():
        out = layer(x)
    assert layer.packed_kernel_weights(x) is not None, "the CPU kernel should run for this layer"
    expected = F.linear(x.float(), layer.dequantized_weight(torch.float32), layer.bias.float())
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert out.dtype == dtype and out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("bits, group_size, int8_activations", [(8, -1, False), (8, -1, True), (4, 64, False),
                                                                (4, 64, True)])
def test_quantized_layer_is_close_to_the_float_layer(bits, group_size, int8_activations):
    layer, weight = quantized_layer(bits, group_size, torch.float32, bias=False, int8_activations=int8_activations)
    x = torch.randn(16, 256)
    with torch.inference_mode():
        out = layer(x)
    expected = F.linear(x, weight)
    relative = float((out - expected).norm() / expected.norm())
    assert relative < (0.01 if bits == 8 else 0.1), relative


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits, group_size", [(8, -1), (4, 32)])
def test_int8_activation_layers_equal_their_reference_with_or_without_the_kernel(monkeypatch, dtype, bits,
                                                                                 group_size):
    layer, _ = quantized_layer(bits, group_size, dtype, int8_activations=True)
    x = torch.randn(2, 9, 256).to(dtype)
    with torch.inference_mode():
        fast = layer(x)
    rows = x.reshape(-1, 256).float()
    exact = (w8a8_linear_reference(rows, layer.qweight, layer.scales) if bits == 8
             else w4a8_linear_reference(rows, layer.qweight, layer.scales, layer.zeros))
    expected = (exact + layer.bias.float()).to(dtype).view(2, 9, 96)
    # w8a8 sums exact integers once; w4a8 sums its groups in float32 in another order
    tolerance = 0 if bits == 8 else 1e-5 if dtype == torch.float32 else 1e-2
    assert fast.dtype == dtype
    torch.testing.assert_close(fast, expected, atol=tolerance, rtol=tolerance)
    monkeypatch.setenv("SERVELAB_NATIVE_CPU", "0")
    assert layer.packed_kernel_weights(x) is None
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)
    with pytest.raises(ValueError, match="need a group size that is a multiple of 8, got group_size=4"):
        QuantizedLinear(256, 8, False, 4, 4, torch.float32, True)


def test_reference_path_runs_without_the_native_switch_and_follows_weight_updates(monkeypatch):
    layer, _ = quantized_layer(4, 32, torch.float32)
    x = torch.randn(3, 5, 256)
    with torch.inference_mode():
        fast = layer(x)
    monkeypatch.setenv("SERVELAB_NATIVE_CPU", "0")
    assert layer.packed_kernel_weights(x) is None
    with torch.inference_mode():
        reference = layer(x)
    assert reference.shape == (3, 5, 96)
    torch.testing.assert_close(fast, reference, atol=1e-4, rtol=1e-4)
    monkeypatch.delenv("SERVELAB_NATIVE_CPU")
    with torch.no_grad():
        layer.scales.mul_(2)
        layer.zeros.mul_(2)
    with torch.inference_mode():
        doubled = layer(x)
    torch.testing.assert_close(doubled - layer.bias, 2 * (fast - layer.bias), atol=1e-4, rtol=1e-4)


def test_a_group_that_does_not_divide_the_layer_is_refused():
    with pytest.raises(ValueError, match="in_features=96"):
        QuantizedLinear(96, 8, False, 4, 64)


def test_checkpoint_rewrite_touches_decoder_linears_only():
    weights = [("model.embed_tokens.weight", torch.randn(32, 64)), ("lm_head.weight", torch.randn(32, 64)),
               ("model.layers.0.input_layernorm.weight", torch.ones(64)),
               ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64)),
               ("model.layers.0.self_attn.q_proj.bias", torch.randn(64))]
    int8 = dict(quantized_weights(weights, WeightQuantization(8, -1)))
    assert sorted(int8) == ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                            "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.qweight",
                            "model.layers.0.self_attn.q_proj.scales"]
    int4 = dict(quantized_weights(weights, WeightQuantization(4, 32)))
    assert int4["model.layers.0.self_attn.q_proj.qweight"].shape == (64, 32)
    assert int4["model.layers.0.self_attn.q_proj.zeros"].shape == (64, 2)
    with pytest.raises(ConfigError, match="group_size=128 does not divide in_features=64 of "
                                          "model.layers.0.self_attn.q_proj"):
        dict(quantized_weights(weights, WeightQuantization(4, 128)))


def test_quantize_linears_replaces_decoder_layers_and_keeps_the_head():
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"proj": Linear(64, 32, bias=True)})])
    model.lm_head = Linear(64, 10, bias=False)
    assert quantize_linears(model, WeightQuantization(4, 32)) == 1
    layer = model.model.layers[0]["proj"]
    assert isinstance(layer, QuantizedLinear) and layer.bias is not None and layer.group_size == 32
    assert type(model.lm_head) is Linear


@pytest.mark.parametrize("int8_activations", [False, True])
def test_a_quantized_head_multiplies_an_int8_copy_of_the_shared_float_weight(int8_activations):
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    model.model.embed_tokens = torch.nn.Embedding(40, 64)
    model.lm_head = Linear(64, 40, bias=False)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    quantize_linears(model, WeightQuantization(8, -1, int8_activations=int8_activations, lm_head=True))
    head = model.lm_head
    assert isinstance(head, QuantizedHead) and head.weight is model.model.embed_tokens.weight
    assert [name for name, _ in model.named_parameters()] == ["model.embed_tokens.weight"]
    runs_kernel = not int8_activations or w8a8_unavailable_reason() is None  # w8a8 needs AVX512-VNNI
    assert pack_quantized_linears(model) == int(runs_kernel)
    x = torch.randn(5, 64)
    qweight, scales = quantize_int8(head.weight.detach())
    expected = (w8a8_linear_reference(x, qweight, scales) if int8_activations
                else x @ dequantize_int8(qweight, scales, torch.float32).T)
    with torch.inference_mode():
        torch.testing.assert_close(head(x), expected, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2)  # a new weight is quantized again
    with torch.inference_mode():
        torch.testing.assert_close(head(x), 2 * expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode, group_size, expected", [
    ("auto", None, None), ("none", None, None), ("int8", None, WeightQuantization(8, -1)),
    ("int4", None, WeightQuantization(4, 128)), ("int4", 64, WeightQuantization(4, 64)),
    ("w8a8", None, WeightQuantization(8, -1, int8_activations=True)),
    ("w4a8", None, WeightQuantization(4, 128, int8_activations=True)),
    ("w4a8", 32, WeightQuantization(4, 32, int8_activations=True)),
])
def test_modes_resolve_on_a_float_checkpoint(mode, group_size, expected):
    config = ModelConfig(quantization=mode, quantization_group_size=group_size)
    assert resolve_quantization(config, SimpleNamespace()) == expected


def test_the_lm_head_option_needs_quantized_weights():
    config = ModelConfig(quantization="w8a8", quantization_lm_head=True)
    assert resolve_quantization(config, SimpleNamespace()) == WeightQuantization(8, -1, False, True, True)
    int4 = ModelConfig(quantization="int4", quantization_lm_head=True)
    assert resolve_quantization(int4, SimpleNamespace()) == WeightQuantization(4, 128, lm_head=True)
    with pytest.raises(ConfigError, match="model.quantization_lm_head=true needs quantized weights "
                                          "\\(model.quantization=int8, w8a8, int4 or w4a8\\), got model.quantization=none"):
        resolve_quantization(ModelConfig(quantization="none", quantization_lm_head=True), SimpleNamespace())
    with pytest.raises(ConfigError, match="got model.quantization=auto$"):
        resolve_quantization(ModelConfig(quantization_lm_head=True), SimpleNamespace())


@pytest.mark.parametrize("mode, head, expected", [
    ("int8", "int8", WeightQuantization(8, -1, lm_head=True)),
    ("int4", "int4", WeightQuantization(4, 128, lm_head=True, lm_head_bits=4)),
    ("w4a8", "int4", WeightQuantization(4, 128, int8_activations=True, lm_head=True, lm_head_bits=4)),
    ("w4a8", "int8", WeightQuantization(4, 128, int8_activations=True, lm_head=True)),
    ("int4", False, WeightQuantization(4, 128)),
])
def test_the_lm_head_option_names_its_bits(mode, head, expected):
    assert resolve_quantization(ModelConfig(quantization=mode, quantization_lm_head=head), SimpleNamespace()) == expected


@pytest.mark.parametrize("mode, head, message", [
    ("int8", "int4", "model.quantization_lm_head=int4 needs int4 layers \\(model.quantization=int4 or w4a8\\), whose "
                     "group size it takes; got model.quantization=int8"),
    ("w8a8", "int4", "got model.quantization=w8a8$"),
    ("int4", "int2", "model.quantization_lm_head must be false, true \\(int8\\), int8 or int4, got 'int2'"),
    ("int4", 1, "model.quantization_lm_head must be false, true \\(int8\\), int8 or int4, got 1"),
    ("none", "int4", "model.quantization_lm_head=int4 needs quantized weights"),
])
def test_a_bad_lm_head_option_is_refused_naming_the_field(mode, head, message):
    with pytest.raises(ConfigError, match=message):
        resolve_quantization(ModelConfig(quantization=mode, quantization_lm_head=head), SimpleNamespace())


@pytest.mark.parametrize("int8_activations", [False, True])
def test_an_int4_head_multiplies_the_int4_groups_of_its_float_weight(int8_activations):
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList()
    model.lm_head = Linear(64, 40, bias=False)
    quantize_linears(model, WeightQuantization(4, 16, int8_activations=int8_activations, lm_head=True, lm_head_bits=4))
    head = model.lm_head
    assert isinstance(head, QuantizedHead) and head.quantized().bits == 4 and head.quantized().group_size == 16
    x = torch.randn(5, 64)
    qweight, scales, zeros = quantize_int4(head.weight.detach(), 16)
    expected = (w4a8_linear_reference(x, qweight, scales, zeros) if int8_activations
                else x @ dequantize_int4(qweight, scales, zeros, torch.float32).T)
    with torch.inference_mode():
        torch.testing.assert_close(head(x), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode, group_size, message", [
    ("int3", None, "model.quantization must be one of auto, none, int8, w8a8, int4, w4a8, got 'int3'"),
    ("w4a8", 12, "model.quantization=w4a8 needs model.quantization_group_size a multiple of 8, got 12"),
    ("int4", 0, "model.quantization_group_size must be a positive even number, got 0"),
    ("int4", 33, "model.quantization_group_size must be a positive even number, got 33"),
])
def test_bad_modes_name_the_field(mode, group_size, message):
    with pytest.raises(ConfigError, match=message):
        resolve_quantization(ModelConfig(quantization=mode, quantization_group_size=group_size), None)


def test_a_saved_folder_decides_unless_the_config_contradicts_it():
    stored = SimpleNamespace(quantization_config={"quant_method": "servelab", "bits": 4, "group_size": 64})
    assert resolve_quantization(ModelConfig(), stored) == WeightQuantization(4, 64, prequantized=True)
    assert resolve_quantization(ModelConfig(quantization="int4"), stored) == WeightQuantization(4, 64, True)
    with pytest.raises(ConfigError, match="model.quantization=int8 but the checkpoint holds int4 weights"):
        resolve_quantization(ModelConfig(quantization="int8"), stored)
    with pytest.raises(ConfigError, match="model.quantization=none but the checkpoint holds int4"):
        resolve_quantization(ModelConfig(quantization="none"), stored)
    with pytest.raises(ConfigError, match="quantization_group_size=128 but the checkpoint's int4 weights are in "
                                          "groups of 64"):
        resolve_quantization(ModelConfig(quantization_group_size=128), stored)
    int8 = SimpleNamespace(quantization_config={"quant_method": "servelab", "bits": 8, "group_size": -1})
    assert resolve_quantization(ModelConfig(quantization="w8a8"), int8) == WeightQuantization(8, -1, True, True)
    with pytest.raises(ConfigError, match="model.quantization=w8a8 but the checkpoint holds int4 weights"):
        resolve_quantization(ModelConfig(quantization="w8a8"), stored)
    assert resolve_quantization(ModelConfig(quantization="w4a8"), stored) == WeightQuantization(4, 64, True, True)
    with pytest.raises(ConfigError, match="model.quantization=w4a8 but the checkpoint holds int8 weights"):
        resolve_quantization(ModelConfig(quantization="w4a8"), int8)
    gptq = SimpleNamespace(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128})
    with pytest.raises(ConfigError, match="quant_method='servelab'"):
        resolve_quantization(ModelConfig(), gptq)


def test_start_up_checks_name_the_device_layer_and_ranks():
    cpu = torch.device("cpu")
    assert quantization_problems(None, SHAPE, 1, torch.device("cuda"), True) == []
    assert quantization_problems(WeightQuantization(4, 64), SHAPE, 1, cpu, True) == []
    [mps] = quantization_problems(WeightQuantization(8, -1), SHAPE, 1, torch.device("mps"), True)
    assert "model.quantization=int8 has no kernel on device=mps" in mps
    assert quantization_problems(WeightQuantization(8, -1), SHAPE, 1, torch.device("mps"), False) == [], \
        "an executor that runs no model needs no kernel"
    [w8a8_cuda] = quantization_problems(WeightQuantization(8, -1, int8_activations=True), SHAPE, 1,
                                        torch.device("cuda"), True)
    assert "model.quantization=w8a8 cannot run here: it runs on the CPU only, not on cuda" in w8a8_cuda
    problems = quantization_problems(WeightQuantization(4, 128), SHAPE, 1, cpu, True)
    assert problems == [
        "model.quantization_group_size=128 does not divide in_features=64 of model.layers.*.self_attn.q_proj, "
        "model.layers.*.self_attn.k_proj, model.layers.*.self_attn.v_proj, model.layers.*.self_attn.o_proj, "
        "model.layers.*.mlp.gate_proj, model.layers.*.mlp.up_proj; pick a group size that divides it",
        "model.quantization_group_size=128 does not divide in_features=192 of model.layers.*.mlp.down_proj; "
        "pick a group size that divides it"]
    shares = quantization_problems(WeightQuantization(4, 64), SHAPE, 2, cpu, True)
    assert [problem.split("; ")[0] for problem in shares] == [
        "model.quantization_group_size=64 does not divide in_features=32 of model.layers.*.self_attn.o_proj "
        "(its share on each of 2 tensor-parallel ranks)",
        "model.quantization_group_size=64 does not divide in_features=96 of model.layers.*.mlp.down_proj "
        "(its share on each of 2 tensor-parallel ranks)"]
