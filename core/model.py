"""The model contract: a causal LM that runs on flat token batches."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from servelab.core.attention import AttentionSpec
from servelab.core.kv_cache import KVCacheSpec


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Sizes the engine needs before building a model: ``num_layers`` attention layers of
    ``num_heads`` query and ``num_kv_heads`` KV heads of ``head_dim``; ``sliding_window``
    (None = full attention); ``max_positions`` and ``vocab_size``."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    max_positions: int
    vocab_size: int

    def attention_spec(self, dtype: torch.dtype, device: torch.device, max_model_len: int) -> AttentionSpec:
        """The attention backend's spec (a window as long as the context is no window)."""
        window = self.sliding_window if self.sliding_window and self.sliding_window < max_model_len else None
        return AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, dtype, device,
                             window)

    def kv_cache_spec(self, dtype: torch.dtype, max_model_len: int) -> KVCacheSpec:
        """What the KV cache stores per token."""
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_dim, dtype, max_model_len)


class CausalLM(nn.Module, abc.ABC):
    """A decoder-only language model over a flat batch of new tokens.

    Implementations are registered under the architecture names of ``config.json``
    (``LlamaForCausalLM``, ...). Each attention layer calls
    ``attention.forward(q, k, v, kv_caches[layer], attn_meta, layer)``.
    """

    @classmethod
    @abc.abstractmethod
    def shape_of(cls, hf_config: Any) -> ModelShape:
        """The model's sizes, read from its Hugging Face config."""

    @abc.abstractmethod
    def __init__(self, hf_config: Any, attention: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters."""

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: Any) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final hidden states [T, hidden]."""

    @abc.abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in float32."""

    def warm_up(self, max_tokens: int) -> int:
        """Prepare whatever kernels steps of up to ``max_tokens`` tokens will need (compiled
        on first use otherwise); returns how many were prepared. Nothing by default."""
        return 0
