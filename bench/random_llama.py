"""The random-weight checkpoints of the vLLM comparison (``benchmarks/compare_vllm*.py``,
``cpu_roofline.py``, ``profile_engine.py``): their shapes, their matmul work per token, and
a folder both engines load.

Seed-0 random weights, vocabulary 2048 unless named, 512 positions, saved by transformers
in float32, with a word-level tokenizer whose every id decodes (``<i>``), so both engines
detokenize whatever they generate:

- ``26m``: hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1536, untied embeddings;
- ``3m``: hidden 256, 4 layers, 8 heads, 4 KV heads, intermediate 688, tied embeddings;
- ``05b``: the shape of Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 KV heads,
  intermediate 4864, vocabulary 151,936, tied embeddings; 494M parameters), for the
  quantization comparison;
- ``moe05b``: a Qwen3-MoE (``Qwen3MoeForCausalLM``: q/k norms, every layer sparse) of hidden
  512, 12 layers, 8 heads of 64, 2 KV heads, 48 experts of 512 with 4 per token,
  normalised; 0.47B parameters, 53M of them active per token.

The workloads draw prompt ids below 2048, which every model's vocabulary holds.
"""

from __future__ import annotations

import os
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "26m": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
            "intermediate_size": 1536, "tie_word_embeddings": False},
    "3m": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
           "intermediate_size": 688, "tie_word_embeddings": True},
    "05b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "tie_word_embeddings": True, "vocab_size": 151936},
    "moe05b": {"model_type": "qwen3_moe", "hidden_size": 512, "num_hidden_layers": 12, "num_attention_heads": 8,
               "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1536, "moe_intermediate_size": 512,
               "num_experts": 48, "num_experts_per_tok": 4, "norm_topk_prob": True, "tie_word_embeddings": False},
}
VOCAB = 2048
MAX_POSITIONS = 512


def word_tokenizer(vocab_size: int) -> Any:
    """A tokenizer whose every id decodes (``<i>`` words); ``<0>`` is BOS and unknown, ``<1>`` EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<0>", bos_token="<0>", eos_token="<1>")


def make_checkpoint(folder: str, name: str) -> str:
    """Write the named model (seed 0) and its tokenizer into ``folder`` unless it holds one."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    shape = {"vocab_size": VOCAB, "model_type": "llama", **MODELS[name]}
    config = AutoConfig.for_model(shape.pop("model_type"), max_position_embeddings=MAX_POSITIONS, bos_token_id=0,
                                  eos_token_id=1, **shape)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    word_tokenizer(shape["vocab_size"]).save_pretrained(folder)
    return folder


def matmul_parameters(name: str, experts: float | None = None) -> float:
    """Parameters that take part in a matmul per token: every linear layer (of a mixture,
    the router and the experts the token passes) and the LM head (the embedding lookup is
    not a matmul); a token costs twice that in FLOPs. ``experts``: the experts a step
    multiplies per sparse layer instead (a batch's tokens together pass more than one
    token's ``num_experts_per_tok``), for the weight bytes a step reads."""
    m = MODELS[name]
    hidden, layers = m["hidden_size"], m["num_hidden_layers"]
    head = m.get("head_dim", hidden // m["num_attention_heads"])
    query, kv = m["num_attention_heads"] * head, m["num_key_value_heads"] * head
    if "num_experts" in m:  # the router and the experts a token passes
        passed = m["num_experts_per_tok"] if experts is None else experts
        mlp = hidden * m["num_experts"] + 3 * hidden * m["moe_intermediate_size"] * passed
    else:
        mlp = 3 * hidden * m["intermediate_size"]
    per_layer = hidden * (query + 2 * kv) + query * hidden + mlp
    return layers * per_layer + hidden * m.get("vocab_size", VOCAB)
