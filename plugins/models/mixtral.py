"""Mixtral (``MixtralForCausalLM``) on flat token batches: Mistral's layers (grouped KV
heads, an optional ``sliding_window``) with every MLP a sparse mixture of
``num_local_experts`` experts of ``intermediate_size``, ``num_experts_per_tok`` per token,
their softmax weights always renormalised over the chosen experts (``moe.py``).

``save_pretrained`` writes the original layout, ``block_sparse_moe.gate`` (the router) and
``block_sparse_moe.experts.N.w1`` / ``w3`` / ``w2`` (gate, up, down); they load into the
shared block's ``mlp.gate`` and stacked ``mlp.experts`` (transformers' in-memory names,
which load as they are).
"""

from __future__ import annotations

from typing import Iterable

import torch

from servelab.core.component import ComponentSpec
from servelab.plugins.models.moe import SparseForCausalLM


class MixtralForCausalLM(SparseForCausalLM):
    """Mixtral (see the module docstring)."""

    EXPERT_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The sparse loader, ``block_sparse_moe.`` read as ``mlp.``."""
        super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), tensor) for name, tensor in weights)


def model_specs() -> list[ComponentSpec]:
    """Registry entry for Mixtral."""
    return [ComponentSpec("model", "MixtralForCausalLM", MixtralForCausalLM, None,
                          "Mixtral decoder, sparse mixture of experts (top-k, fused experts)")]
