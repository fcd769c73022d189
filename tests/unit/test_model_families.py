"""Phi-3, OPT, Falcon, Gemma, DeepSeek-V2 and the mixtures of experts (Mixtral, Qwen2-MoE,
Qwen3-MoE, DeepSeek-V2's and V3's): what their configs refuse, and shapes that count what they hold (Gemma's: each
layer's window, the attention scale and soft cap; DeepSeek-V2's: one latent KV head; the
mixtures': the active experts' width, every expert held)."""

from __future__ import annotations

import pytest

import torch

from servelab import ConfigError, LLM, SamplingParams
from servelab.core.engine.registry import get_registry
from servelab.testing import mixed_prompts, tiny_checkpoint, tiny_config

BASE = ["model.dtype=float32", "device=cpu"]


ARCHITECTURES = {"phi3": "Phi3ForCausalLM", "opt": "OPTForCausalLM", "falcon": "FalconForCausalLM",
                 "falcon-new": "FalconForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "deepseek-v2": "DeepseekV2ForCausalLM", "deepseek-v2-qlora": "DeepseekV2ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen2-moe": "Qwen2MoeForCausalLM",
                 "qwen3-moe": "Qwen3MoeForCausalLM", "deepseek-v2-moe": "DeepseekV2ForCausalLM",
                 "deepseek-v3": "DeepseekV3ForCausalLM"}


def shape(family: str, **fields):
    """``family``'s tiny config through its registered model's ``shape_of``."""
    return get_registry().get("model", ARCHITECTURES[family]).cls.shape_of(tiny_config(family, 257, **fields))


@pytest.mark.parametrize("fields, message", [
    ({"alibi": True}, "alibi=true is not supported"),
    ({"parallel_attn": False}, "new_decoder_architecture=true and parallel_attn=false is not supported"),
])
def test_falcon_refuses_what_it_cannot_run(tmp_path, fields, message):
    folder = tiny_checkpoint(tmp_path / "falcon", "falcon-new", **fields)
    with pytest.raises(ConfigError, match=message):
        LLM(folder, overrides=BASE)


def test_an_unsupported_rope_type_names_the_field_and_the_supported_ones(tmp_path):
    folder = tiny_checkpoint(tmp_path / "llama", "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                           "rope_theta": 10000.0})
    with pytest.raises(ConfigError, match=r"rope_scaling.rope_type 'dynamic' is not supported; supported: .*longrope"):
        LLM(folder, overrides=BASE)


def test_an_unknown_architecture_keeps_its_clear_error(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).save_pretrained(folder)
    with pytest.raises(ConfigError, match="unknown model 'GPT2LMHeadModel'; available: .*FalconForCausalLM"):
        LLM(str(folder), overrides=BASE)


def test_plain_mlps_count_two_matrices_and_price_one_up_projection():
    from servelab.plugins.cost_model.operators import Widths, layer_operators

    opt, phi3 = shape("opt"), shape("phi3")
    assert opt.mlp_kind == "plain" and phi3.mlp_kind == "gated"
    # OPT layer: q, k, v, out (4 h^2), fc1 and fc2 (2 h ffn), two LayerNorm weights
    assert opt.layer_parameters == 4 * 64 * 64 + 2 * 64 * 128 + 2 * 64
    assert "mlp.gate_proj" not in opt.linear_shapes() and "mlp.gate_proj" in phi3.linear_shapes()
    up = {op.name: op for op in layer_operators(8, Widths.of(opt, 1, 4, 4, 4))}["mlp_up_proj"]
    assert up.flops == 2.0 * 8 * 64 * 128


def test_falcon_shapes_follow_the_layout():
    assert (shape("falcon").num_kv_heads, shape("falcon-new").num_kv_heads) == (1, 2)
    assert shape("falcon", multi_query=False).num_kv_heads == 4


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> str:
    """A tiny Gemma 2 checkpoint (soft-capped attention and logits)."""
    return tiny_checkpoint(tmp_path_factory.mktemp("gemma") / "gemma2", "gemma2")


def test_gemma_shapes_declare_each_layers_window_the_scale_and_the_cap():
    gemma2, gemma3 = shape("gemma2"), shape("gemma3")
    assert (gemma2.sliding_window, gemma2.layer_windows, gemma2.attention_softcap) == (16, (16, None), 0.5)
    assert (gemma3.sliding_window, gemma3.layer_windows, gemma3.attention_softcap) == (8, (8, None, 8), None)
    spec = gemma2.attention_spec(torch.float32, torch.device("cpu"), 128)
    assert (spec.scale, spec.softcap) == (24 ** -0.5, 0.5)


def test_a_gemma_window_as_long_as_the_positions_is_no_window():
    whole = shape("gemma3", sliding_window=256)
    assert whole.sliding_window is None and whole.layer_windows == (None, None, None)


@pytest.mark.parametrize("fields, message", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     r"layer_types\[1\] 'chunked_attention' is not supported; supported: sliding_attention, full_attention"),
    ({"layer_types": ["full_attention"]}, r"layer_types has 1 entries; expected one per layer \(num_hidden_layers=3\)"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
])
def test_gemma_refuses_what_it_cannot_run(fields, message):
    with pytest.raises(ConfigError, match=message):
        shape("gemma3", **fields)


def test_gemma3_names_the_layer_type_of_an_unsupported_rope(tmp_path):
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000000.0}}
    folder = tiny_checkpoint(tmp_path / "gemma3", "gemma3", rope_parameters=rope)
    with pytest.raises(ConfigError, match=r"rope_parameters.full_attention.rope_type 'dynamic' is not supported"):
        LLM(folder, overrides=BASE)


def test_gemma2_on_attention_cpu_names_the_soft_cap(gemma2):
    with pytest.raises(ConfigError, match=r"attention=cpu does not soft-cap attention scores \(softcap 0.5\)"):
        LLM(gemma2, overrides=[*BASE, "attention=cpu"])


def test_gemma_logprobs_come_from_soft_capped_logits(gemma2):
    """Greedy tokens cannot show the final cap (tanh keeps the logits' order); logprobs do."""
    from transformers import AutoModelForCausalLM

    prompt = mixed_prompts(257, (12,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    (out,) = LLM(gemma2, overrides=BASE).generate([prompt], params, use_tqdm=False)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(gemma2, dtype=torch.float32)(torch.tensor([prompt])).logits[0]
    assert logits.abs().max() < 1.0  # capped at final_logit_softcapping=1.0
    expected = logits.log_softmax(-1)
    for position in range(1, len(prompt)):
        got = out.prompt_logprobs[position][prompt[position]].logprob
        assert got == pytest.approx(expected[position - 1, prompt[position]].item(), abs=1e-4)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
"""DeepSeek-V2's rope scaling, small: yarn with ``mscale_all_dim`` (which scales the softmax too)."""


def test_deepseek_v2_attends_as_multi_query_attention_over_one_latent_head():
    mla = shape("deepseek-v2")
    assert (mla.latent.cached_width, mla.head_dim, mla.attention_scale) == (24 + 8, 8 + 8, None)
    for tp, heads in ((1, 4), (2, 2)):
        spec = mla.attention_spec(torch.float32, torch.device("cpu"), 128, tp)
        assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.scale) == (heads, 1, 32, 16 ** -0.5)
        assert spec.values_are_keys
        cache = mla.kv_cache_spec(torch.float32, 128, tp)
        # the latent and rotary key once, as one KV head whose values are its keys, whole on every rank
        assert (cache.num_kv_heads, cache.head_dim, cache.bytes_per_token) == (1, 32, 2 * 32 * 4)
    qlora = shape("deepseek-v2-qlora")
    assert qlora.linear_shapes(2)["self_attn.q_b_proj"] == (2 * 16, 24)
    assert qlora.layer_parameters == (24 * 64 + 4 * 16 * 24 + 24 * 64 + 4 * 16 * 16 + 64 * 4 * 8 + 3 * 64 * 128
                                      + 2 * 64 + 16 + 24)


def test_deepseek_v2_scales_the_softmax_as_transformers_does_under_yarn():
    from transformers import AutoModelForCausalLM

    config = tiny_config("deepseek-v2", 257, rope_parameters=YARN)
    expected = AutoModelForCausalLM.from_config(config).model.layers[0].self_attn.scaling
    assert shape("deepseek-v2", rope_parameters=YARN).attention_scale == pytest.approx(expected, rel=1e-12)
    assert expected != 16 ** -0.5


def test_deepseek_v2_names_an_unsupported_rope_type():
    with pytest.raises(ConfigError, match=r"rope_scaling.rope_type 'dynamic' is not supported; supported: .*yarn"):
        shape("deepseek-v2", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})


def test_deepseek_v2_splits_by_query_heads_only():
    mla = shape("deepseek-v2")
    assert mla.parallel_problems(2, 2) == [] and mla.kv_heads_per_rank(4) == 1
    assert mla.parallel_problems(3, 1) == ["parallel.tensor_parallel_size=3 does not divide the model's 4 "
                                           "attention heads", "parallel.tensor_parallel_size=3 does not divide the "
                                           "MLP's intermediate size 128"]


def test_deepseek_v3_without_interleaved_rope_matches_transformers(tmp_path):
    """``rope_interleave=false`` rotates halves: the checkpoint loads without reordering."""
    from servelab.testing import assert_engine_matches_transformers

    folder = tiny_checkpoint(tmp_path / "halves", "deepseek-v3", rope_interleave=False)
    assert_engine_matches_transformers(folder, prompts=mixed_prompts(257, (5, 30)), max_tokens=8)


def test_deepseek_v2_on_attention_auto_takes_a_backend_for_its_latent_head(tmp_path):
    """The q_lora layout caches heads of 16 + 8: attention=cpu only where the SIMD width
    divides 24; attention=auto picks one that runs it."""
    from servelab.testing import assert_engine_matches_transformers

    folder = tiny_checkpoint(tmp_path / "qlora", "deepseek-v2-qlora")
    assert_engine_matches_transformers(folder, ["attention=auto"], max_tokens=8)


@pytest.mark.parametrize("attention", ["naive", "cpu"])
def test_deepseek_v2_caches_each_latent_once(tmp_path, attention):
    """The pool is sized by the latent's own bytes: each layer's cache tensor holds keys
    alone (the values are read out of them), so a budget holds twice the blocks of a
    key-and-value layout of the same width; a long generation still matches transformers."""
    from servelab.testing import assert_engine_matches_transformers

    folder = tiny_checkpoint(tmp_path / "mla", "deepseek-v2")
    budget = 200_000
    llm = LLM("local", overrides=[f"model.path={folder}", "model.dtype=float32", f"cache.memory_bytes={budget}"],
              attention=attention)
    engine = llm.engine
    latent, layers = engine.shape.latent, engine.shape.num_layers
    block_bytes = layers * latent.cached_width * 4 * engine.cache.block_size  # one latent head, float32
    assert engine.cache.num_blocks == budget // block_bytes
    assert {cache.numel() * 4 for cache in engine.executor.kv_caches} == {budget // block_bytes * block_bytes // layers}
    llm.shutdown()
    assert_engine_matches_transformers(folder, [f"attention={attention}", f"cache.memory_bytes={budget}"],
                                       prompts=mixed_prompts(257, (40, 70)), max_tokens=24)


def test_latent_attention_is_refused_with_a_backend_that_reads_values_apart(tmp_path, monkeypatch):
    from servelab.plugins.attention.naive import NaiveAttention

    folder = tiny_checkpoint(tmp_path / "mla", "deepseek-v2")
    monkeypatch.setattr(NaiveAttention, "reads_values_from_keys", False)
    with pytest.raises(ConfigError, match=r"attention=naive does not read values out of the keys, as "
                                          r"DeepseekV2ForCausalLM's latent attention caches them"):
        LLM("local", overrides=[f"model.path={folder}"], attention="naive")


MIXTURES = ("mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v2-moe", "deepseek-v3")
"""The mixture-of-experts families' oracle configs."""


@pytest.mark.parametrize("family, experts", [("mixtral", (4, 2, 32, 0, ())), ("qwen2-moe", (8, 2, 32, 48, (0,))),
                                             ("qwen3-moe", (6, 2, 32, 0, ())), ("deepseek-v2-moe", (8, 2, 32, 32, (0,))),
                                             ("deepseek-v3", (8, 2, 32, 32, (0,)))])
def test_a_mixture_of_experts_describes_its_experts_and_holds_them_all(family, experts):
    """``ModelShape.experts`` gives the routed experts, top-k, widths and dense layers the
    cost models price; the parameter count is transformers' (less biases and q/k norms,
    which shapes leave out)."""
    from transformers import AutoModelForCausalLM

    moe = shape(family)
    described = moe.experts
    assert (described.num_experts, described.top_k, described.expert_intermediate_size,
            described.shared_intermediate_size, described.dense_layers) == experts
    held = AutoModelForCausalLM.from_config(tiny_config(family, 257)).named_parameters()
    assert moe.num_parameters == sum(p.numel() for name, p in held
                                     if not name.endswith(("bias", "q_norm.weight", "k_norm.weight")))


@pytest.mark.parametrize("family, fields", [*((family, {}) for family in MIXTURES), ("mixtral", {"sliding_window": 8})],
                         ids=[*MIXTURES, "mixtral-window"])
def test_mixtures_of_experts_match_transformers(tmp_path, family, fields):
    """Chunked prefills beside decodes: each step routes a mix of prompt and generated tokens."""
    from servelab.testing import assert_engine_matches_transformers

    folder = tiny_checkpoint(tmp_path / family, family, **fields)
    assert_engine_matches_transformers(folder, ["scheduler=chunked", "scheduler.token_budget=24"],
                                       prompts=mixed_prompts(257, (5, 30, 12)), max_tokens=8)


@pytest.mark.parametrize("family, fields, message", [
    ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok=5 must be in \[1, num_local_experts=4\]"),
    ("qwen3-moe", {"num_experts_per_tok": 0}, r"num_experts_per_tok=0 must be in \[1, num_experts=6\]"),
    ("qwen2-moe", {"use_sliding_window": True}, "qwen2_moe with use_sliding_window=true is not supported"),
    ("deepseek-v3", {"n_group": 3}, "n_group=3 must divide n_routed_experts=8"),
    ("deepseek-v3", {"topk_group": 5}, r"topk_group=5 must be in \[1, n_group=4\]"),
    ("deepseek-v3", {"num_experts_per_tok": 5}, "num_experts_per_tok=5 must be at most topk_group=2 x 2 experts per "
                                                "group"),
    ("deepseek-v3", {"n_group": 8, "topk_group": 4}, "n_group=8 leaves one expert per group of n_routed_experts=8"),
    ("deepseek-v2-moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be in \[1, n_routed_experts=8\]"),
    ("deepseek-v2-moe", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported"),
])
def test_mixtures_of_experts_refuse_what_they_cannot_run(family, fields, message):
    with pytest.raises(ConfigError, match=message):
        shape(family, **fields)


@pytest.mark.parametrize("family, fields, message", [
    ("mixtral", {"intermediate_size": 34}, "tensor_parallel_size=4 does not divide the experts' intermediate_size 34"),
    ("qwen2-moe", {"shared_expert_intermediate_size": 50},
     "tensor_parallel_size=4 does not divide the shared expert's shared_expert_intermediate_size 50"),
    ("qwen2-moe", {"intermediate_size": 130}, "tensor_parallel_size=4 does not divide the dense layers' "
                                              "intermediate_size 130"),
    ("deepseek-v3", {"moe_intermediate_size": 34}, "tensor_parallel_size=4 does not divide the experts' "
                                                   "moe_intermediate_size 34"),
])
def test_a_split_of_the_experts_that_cannot_work_names_the_field(family, fields, message):
    from servelab.core.model import ModelParallel

    model_cls = get_registry().get("model", ARCHITECTURES[family]).cls
    with pytest.raises(ConfigError, match=message):
        model_cls(tiny_config(family, 257, **fields), None, torch.float32, 64, ModelParallel(tp_size=4))


def test_a_missing_expert_weight_names_the_layer_expert_and_projection(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tiny_checkpoint(tmp_path / "mixtral", "mixtral")
    weights = load_file(f"{folder}/model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="checkpoint is missing expert weights: layer 1 expert 2 up_proj"):
        LLM(folder, overrides=BASE)


def test_weight_quantization_names_the_weights_it_cannot_cover(monkeypatch):
    """Decoder weights outside linear layers that no module quantizes (here stacked experts
    whose quantize_weights is gone) are refused at load, each named once."""
    from servelab.core.model import ModelParallel
    from servelab.core.quantization import WeightQuantization
    from servelab.plugins.models.moe import ExpertWeights
    from servelab.plugins.models.quantized_linear import quantize_linears

    monkeypatch.delattr(ExpertWeights, "quantize_weights")
    model_cls = get_registry().get("model", ARCHITECTURES["mixtral"]).cls
    model = model_cls(tiny_config("mixtral", 257), None, torch.float32, 64, ModelParallel())
    with pytest.raises(ConfigError, match=r"model.quantization: MixtralForCausalLM has decoder weights weight "
                                          r"quantization does not cover: mlp.experts.down_proj \(StackedWeight\), "
                                          r"mlp.experts.gate_up_proj \(StackedWeight\)$"):
        quantize_linears(model, WeightQuantization(8, -1))
