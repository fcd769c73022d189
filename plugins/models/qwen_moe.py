"""Qwen2-MoE (``Qwen2MoeForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``) on flat
token batches: Qwen2's and Qwen3's layers (q/k/v biases from ``qkv_bias``; q/k RMSNorm)
with sparse mixtures of ``num_experts`` experts of ``moe_intermediate_size`` in the layers
``decoder_sparse_step`` selects, except ``mlp_only_layers``, which keep a dense gated MLP of
``intermediate_size``. The top ``num_experts_per_tok`` softmax weights are renormalised
only with ``norm_topk_prob``. Qwen2-MoE adds a shared expert of
``shared_expert_intermediate_size`` every token passes, scaled by the sigmoid of
``shared_expert_gate`` (``moe.py``). ``use_sliding_window=true`` is refused.
"""

from __future__ import annotations

from typing import Any

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.model import ModelShape
from servelab.plugins.models.moe import SparseForCausalLM


class QwenMoeForCausalLM(SparseForCausalLM):
    """Qwen2-MoE and Qwen3-MoE (see the module docstring; the config's ``model_type`` says
    which attention and experts it has)."""

    @classmethod
    def shape_of(cls, hf_config: Any) -> ModelShape:
        """The sparse shape; refuses sliding-window attention."""
        if getattr(hf_config, "use_sliding_window", False):
            raise ConfigError([f"{hf_config.model_type} with use_sliding_window=true is not supported"])
        return super().shape_of(hf_config)


def model_specs() -> list[ComponentSpec]:
    """Registry entries for Qwen2-MoE and Qwen3-MoE."""
    return [ComponentSpec("model", "Qwen2MoeForCausalLM", QwenMoeForCausalLM, None,
                          "Qwen2-MoE decoder, routed and gated shared experts, dense mlp_only_layers"),
            ComponentSpec("model", "Qwen3MoeForCausalLM", QwenMoeForCausalLM, None,
                          "Qwen3-MoE decoder, q/k norms, routed experts, dense mlp_only_layers")]
