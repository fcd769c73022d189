"""The sparse mixture-of-experts block: fused expert execution equals a per-token loop,
routing follows transformers' math, both checkpoint layouts load the same weights, and the
sparse layers are the ones transformers builds with experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from servelab.core.model import ModelParallel
from servelab.plugins.models.moe import ExpertLayout, ExpertWeights
from servelab.plugins.models.routing import Router, Routing
from servelab.testing import tiny_config


def naive_experts(experts: ExpertWeights, x: torch.Tensor, weights: torch.Tensor,
                  chosen: torch.Tensor) -> torch.Tensor:
    """The weighted sum of each token's experts, one token and one choice at a time."""
    out = torch.zeros_like(x)
    inter = experts.intermediate
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), chosen[t].tolist()):
            gate_up = experts.gate_up_proj.expert(e)
            hidden = F.silu(x[t] @ gate_up[:inter].T) * (x[t] @ gate_up[inter:].T)
            out[t] += w * (hidden @ experts.down_proj.expert(e).T)
    return out


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_fused_experts_equal_a_per_token_loop_on_random_routing(tokens):
    torch.manual_seed(tokens)
    layout = ExpertLayout(num_experts=6, routing=Routing(top_k=2, normalize=True), intermediate_size=24, sparse_layers=(0,))
    experts = ExpertWeights(layout, 32, ModelParallel(), 0, F.silu, True)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.2)
        x = torch.randn(tokens, 32)
        chosen = torch.stack([torch.randperm(6)[:2] for _ in range(tokens)])  # expert 5 gets none at 1 token
        weights = torch.rand(tokens, 2)
        fused = experts(x, weights, chosen)
    assert torch.allclose(fused, naive_experts(experts, x, weights, chosen), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family, router", [("mixtral", "MixtralTopKRouter"), ("qwen2-moe", "Qwen2MoeTopKRouter"),
                                            ("qwen3-moe", "Qwen3MoeTopKRouter")])
def test_routing_is_transformers_router(family, router):
    import importlib

    config = tiny_config(family, 257)
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    hf_router = getattr(module, router)(config)
    torch.manual_seed(0)
    with torch.no_grad():
        hf_router.weight.normal_(0, 0.5)
        x = torch.randn(9, 64)
        _, expected_weights, expected_experts = hf_router(x)
        router = Router(64, hf_router.weight.shape[0], ExpertLayout.of(config).routing)
        router.weight.copy_(hf_router.weight)
        weights, experts = router(x)
    assert torch.equal(experts, expected_experts)
    assert torch.allclose(weights, expected_weights, atol=1e-7)


@pytest.mark.parametrize("family, fields", [("deepseek-v2-moe", {}), ("deepseek-v2-moe", {"topk_method": "greedy"}),
                                            ("deepseek-v3", {}), ("deepseek-v3", {"norm_topk_prob": False})],
                         ids=["v2-grouped", "v2-greedy", "v3", "v3-unnormalised"])
def test_deepseek_routing_is_transformers_router(family, fields):
    """The same experts and weights as transformers' router over 200 tokens (its top-k is
    unsorted: compared by expert), with a correction bias that changes V3's choices."""
    import importlib

    config = tiny_config(family, 257, **fields)
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    hf_router = getattr(module, f"{type(config).__name__[:-len('Config')]}TopkRouter")(config)
    router = Router(64, 8, ExpertLayout.of(config).routing)
    torch.manual_seed(0)
    with torch.no_grad():
        hf_router.weight.normal_(0, 0.5)
        router.weight.copy_(hf_router.weight)
        if hasattr(hf_router, "e_score_correction_bias"):
            hf_router.e_score_correction_bias.normal_(0, 0.3)
            router.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
        x = torch.randn(200, 64)
        _, expected_weights, expected_experts = hf_router(x)
        weights, experts = router(x)
    expected_order, order = expected_experts.argsort(dim=1), experts.argsort(dim=1)
    assert torch.equal(experts.gather(1, order), expected_experts.gather(1, expected_order))
    assert torch.allclose(weights.gather(1, order), expected_weights.gather(1, expected_order), atol=1e-6)


def test_grouped_routing_keeps_each_token_in_its_best_groups():
    """DeepSeek-V3's rule by hand: 8 experts in 4 groups, the best 2 groups by the sum of
    their two best biased scores; the top-2 come from those groups even where a better
    single expert sits elsewhere; weights are unbiased scores, renormalised, scaled."""
    routing = Routing(top_k=2, normalize=True, scoring="sigmoid", groups=4, top_groups=2, group_score="top2_sum",
                      scale=2.0, correction_bias=True)
    scores = torch.tensor([[0.9, 0.1, 0.6, 0.6, 0.5, 0.5, 0.2, 0.2]])  # groups: 1.0, 1.2, 1.0, 0.4
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0])  # group 2 -> 1.05
    weights, experts = routing.route(torch.logit(scores), bias)
    assert sorted(experts[0].tolist()) == [2, 3]  # expert 0 (0.9) is in a group left out
    assert torch.allclose(weights[0], torch.tensor([1.0, 1.0]))


def test_both_checkpoint_layouts_load_the_same_experts(tmp_path):
    """save_pretrained's per-expert tensors and transformers' own stacked ones (its
    state_dict) fill every parameter alike, on each tensor-parallel rank."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from servelab.plugins.models.qwen_moe import QwenMoeForCausalLM

    config = tiny_config("qwen2-moe", 257)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config)
    hf_model.save_pretrained(tmp_path)
    per_expert = load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in per_expert
    stacked = hf_model.state_dict()
    assert stacked["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    for parallel in (ModelParallel(), ModelParallel(tp_rank=1, tp_size=2)):
        models = []
        for weights in (per_expert, stacked):
            model = QwenMoeForCausalLM(config, None, torch.float32, 64, parallel)
            model.load_weights(iter(weights.items()))
            models.append(dict(model.named_parameters()))
        assert all(torch.equal(models[0][name], models[1][name]) for name in models[0])
    experts = models[0]["model.layers.1.mlp.experts.gate_up_proj.weight"].view(8, 2, 16, 64)
    # rank 1's gate and up rows of expert 3: the second half of each
    assert torch.equal(experts[3, 1], per_expert["model.layers.1.mlp.experts.3.up_proj.weight"][16:])


@pytest.mark.parametrize("family, fields", [("qwen2-moe", {"decoder_sparse_step": 2, "mlp_only_layers": [3],
                                                          "layer_types": ["full_attention"] * 4}),
                                            ("qwen3-moe", {"decoder_sparse_step": 1, "mlp_only_layers": [0, 2]}),
                                            ("mixtral", {})])
def test_sparse_layers_are_those_transformers_builds_with_experts(family, fields):
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, 257, num_hidden_layers=4, **fields)
    layers = AutoModelForCausalLM.from_config(config).model.layers
    expected = tuple(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
    assert ExpertLayout.of(config).sparse_layers == expected


def test_both_checkpoint_layouts_load_the_same_int8_experts():
    """The quantizer's per-expert qweight and scales, and transformers' stacked float
    tensors quantized as they load (a row's scale over all its columns), fill every
    parameter alike, on each tensor-parallel rank and under expert parallelism."""
    from transformers import AutoModelForCausalLM

    from servelab.core.quantization import WeightQuantization, quantized_weights
    from servelab.plugins.models.quantized_linear import quantize_linears
    from servelab.plugins.models.qwen_moe import QwenMoeForCausalLM

    config = tiny_config("qwen2-moe", 257)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config)
    stacked = hf_model.state_dict()
    int8 = WeightQuantization(8, -1)
    per_expert = dict(quantized_weights(
        ((name, tensor) for name, tensor in stacked.items() if ".experts." not in name), int8))
    for e in range(8):  # the layer-1 experts one by one, as save_pretrained writes them
        for i, projection in enumerate(("gate_proj", "up_proj")):
            half = stacked["model.layers.1.mlp.experts.gate_up_proj"][e].chunk(2)[i]
            per_expert.update(quantized_weights([(f"model.layers.1.mlp.experts.{e}.{projection}.weight", half)], int8))
        down = stacked["model.layers.1.mlp.experts.down_proj"][e]
        per_expert.update(quantized_weights([(f"model.layers.1.mlp.experts.{e}.down_proj.weight", down)], int8))
    stacked_quantized = dict(quantized_weights(stacked.items(), int8))
    for parallel in (ModelParallel(), ModelParallel(tp_rank=1, tp_size=2),
                     ModelParallel(tp_rank=1, tp_size=2, expert_parallel=True)):
        models = []
        for weights in (per_expert, stacked_quantized):
            model = QwenMoeForCausalLM(config, None, torch.float32, 64, parallel)
            quantize_linears(model, int8)
            model.load_weights(iter(weights.items()))
            models.append(dict(model.named_parameters()))
        assert models[0].keys() == models[1].keys()
        assert all(torch.equal(models[0][name], models[1][name]) for name in models[0])
    assert models[0]["model.layers.1.mlp.experts.gate_up_proj.qweight"].dtype == torch.int8
