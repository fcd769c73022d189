"""Phi-3, OPT, Falcon and Gemma: what their configs refuse, and shapes that count what they
hold (Gemma's: each layer's window, the attention scale and soft cap)."""

from __future__ import annotations

import pytest

import torch

from servelab import ConfigError, LLM, SamplingParams
from servelab.core.engine.registry import get_registry
from servelab.testing import mixed_prompts, tiny_checkpoint, tiny_config

BASE = ["model.dtype=float32", "device=cpu"]


ARCHITECTURES = {"phi3": "Phi3ForCausalLM", "opt": "OPTForCausalLM", "falcon": "FalconForCausalLM",
                 "falcon-new": "FalconForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


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
