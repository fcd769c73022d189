"""model.shape: each architecture's transformers config from the sizes (OPT's and Falcon's
own names), weightless shapes read by their implementation as the sizes say, and errors
that name the field."""

from __future__ import annotations

import pytest

from servelab import ConfigError, LLM, SamplingParams
from servelab.core.checkpoint import load_checkpoint
from servelab.core.engine.llm_engine import LLMEngine
from servelab.core.entrypoints.compose import compose_config
from servelab.core.model import MixtureOfExperts

SIMULATED = ["executor=simulated", "cost_model=roofline", "hardware=a100-80gb"]


def test_opt_and_falcon_shapes_build_their_own_configs():
    opt = load_checkpoint(compose_config(["model=toy", "model.shape.architecture=OPTForCausalLM",
                                          "model.shape.num_key_value_heads=4"]).model).hf_config
    assert (opt.model_type, opt.ffn_dim, opt.word_embed_proj_dim) == ("opt", 128, 64)
    layouts = {}
    for kv_heads in (1, 2, 4):
        falcon = load_checkpoint(compose_config(["model=toy", "model.shape.architecture=FalconForCausalLM",
                                                 f"model.shape.num_key_value_heads={kv_heads}"]).model).hf_config
        layouts[kv_heads] = (falcon.ffn_hidden_size, falcon.new_decoder_architecture, falcon.multi_query)
    assert layouts == {1: (128, False, True), 2: (128, True, False), 4: (128, False, False)}


@pytest.mark.parametrize("architecture, kv_heads", [("OPTForCausalLM", 4), ("FalconForCausalLM", 2)])
def test_random_opt_and_falcon_shapes_run(architecture, kv_heads):
    llm = LLM(overrides=["model=toy", f"model.shape.architecture={architecture}",
                         f"model.shape.num_key_value_heads={kv_heads}", "device=cpu"])
    assert llm.engine.shape.mlp_kind == "plain" and llm.engine.shape.num_kv_heads == kv_heads
    (output,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                             use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


def test_deepseek_v2_reads_a_weightless_shape_as_its_sizes_say():
    from servelab.core.shape_config import model_shape_of

    cfg = compose_config(["model=deepseek-v2-lite", *SIMULATED])
    engine = LLMEngine(cfg)
    shape = engine.shape
    assert engine.executor.context.model_cls.__name__ == "DeepseekV2ForCausalLM"
    assert shape == model_shape_of(cfg.model.shape, 102400)
    assert shape.latent.cached_width == 576 and shape.head_dim == 192
    # the first layer dense, the other 26 route to 6 of 64 experts beside 2 shared; the memory holds all
    assert shape.intermediate_size == 10944
    assert shape.experts == MixtureOfExperts(64, 6, 1408, 2 * 1408, (0,))
    assert shape.num_parameters / 1e9 == pytest.approx(15.7, abs=0.05)
    with pytest.raises(ConfigError, match="has no weights: executor=model runs checkpoints; use executor=simulated"):
        LLMEngine(compose_config(["model=deepseek-v2-lite", "device=cpu"]))


@pytest.mark.parametrize("overrides, message", [
    (["model=deepseek-v2-lite", "model.shape.head_dim=128"], "model.shape.head_dim=128 disagrees with model.shape.latent"),
    (["model=deepseek-v2-lite", "model.shape.experts.num_experts_per_tok=65"],
     r"model.shape.experts.num_experts_per_tok must be in \[1, n_routed_experts=64\]"),
    (["model=gemma-3-27b", "model.shape.sliding_window=null"], "model.shape.window_pattern needs model.shape.sliding"),
    (["model=mixtral-8x7b", "model.shape.experts.n_shared_experts=1"],
     "model.shape.experts: MixtralForCausalLM has neither dense layers nor shared experts"),
    (["model=qwen3-30b-a3b", "model.shape.experts.mlp_only_layers=[48]"],
     r"model.shape.experts.mlp_only_layers: \[48\] are not layers of the model's 48"),
    (["model=toy", "model.shape.architecture=OPTForCausalLM"],
     "model.shape.num_key_value_heads=2: OPTForCausalLM has as many KV heads as attention heads"),
    (["model=toy", "model.shape.architecture=FalconForCausalLM", "model.shape.head_dim=8"],
     "model.shape.head_dim=8: FalconForCausalLM's heads are hidden_size / num_attention_heads"),
    (["model=deepseek-v2-lite", "model.shape.architecture=LlamaForCausalLM"],
     "model.shape.latent: LlamaForCausalLM's servelab implementation has no latent attention"),
    (["model=deepseek-v2-lite", "model.shape.latent=null"],
     "model.shape.latent=null: DeepseekV2ForCausalLM's servelab implementation always runs latent attention"),
])
def test_shape_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        LLMEngine(compose_config([*overrides, *SIMULATED]))
