"""Phi-3, OPT and Falcon: what their configs refuse, and shapes that count what they hold."""

from __future__ import annotations

import pytest

from servelab import ConfigError, LLM
from servelab.core.engine.registry import get_registry
from servelab.testing import tiny_checkpoint, tiny_config

BASE = ["model.dtype=float32", "device=cpu"]


ARCHITECTURES = {"phi3": "Phi3ForCausalLM", "opt": "OPTForCausalLM", "falcon": "FalconForCausalLM",
                 "falcon-new": "FalconForCausalLM"}


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
