"""Architectures of the pair and how a fresh model is built (Hugging Face Llama, float32)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one of the two models (head size is ``hidden_size / num_heads``)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


TARGET = ModelSpec("tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                   intermediate_size=768)
DRAFT = ModelSpec("tiny-draft", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=384)


def build_model(spec: ModelSpec, vocab_size: int, eot: int, max_positions: int,
                init_std: float = 0.02) -> LlamaForCausalLM:
    """A freshly initialised float32 Llama for ``spec`` with tied input/output embeddings.

    Seed torch before calling: the initialisation draws from its default generator.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=init_std,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def count_parameters(model) -> int:
    """Count unique parameters (tied embeddings are counted once)."""
    return sum(p.numel() for p in model.parameters())
