"""Phi-3 (``Phi3ForCausalLM``): a Llama-layout decoder whose checkpoint already fuses q/k/v
(``qkv_proj``, [all q | all k | all v]) and gate/up (``gate_up_proj``, [gate | up]).

It runs on the Llama family's modules: their ``pieces`` split the fused tensors per
tensor-parallel rank exactly as they fuse Llama's separate ones. What Phi-3 adds is read
from its config: ``partial_rotary_factor`` (rotary embedding of the first part of each
head, ``decoder.RotaryEmbedding``), ``rope_scaling`` of type ``longrope`` (short factors
below ``original_max_position_embeddings``, long ones past it) and an optional
``sliding_window``. No attention or MLP biases.
"""

from __future__ import annotations

from servelab.core.component import ComponentSpec
from servelab.plugins.models.llama import LlamaFamilyForCausalLM

ARCHITECTURES = ("Phi3ForCausalLM",)


class Phi3ForCausalLM(LlamaFamilyForCausalLM):
    """Phi-3 (see the module docstring): the Llama family's modules and loader."""


def model_specs() -> list[ComponentSpec]:
    """Registry entries for Phi-3."""
    return [ComponentSpec("model", name, Phi3ForCausalLM, None, "Phi-3 decoder (fused qkv and gate/up, longrope)")
            for name in ARCHITECTURES]
