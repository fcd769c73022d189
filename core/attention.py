"""The attention backend contract and the flat batch layout it reads."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """The attention shape of one model: ``num_heads`` query heads and ``num_kv_heads``
    KV heads of ``head_dim``, softmax ``scale``, compute ``dtype`` on ``device``, and an
    optional ``sliding_window`` (None = full attention)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype
    device: torch.device
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """One step's flat token batch: R requests, T new tokens, no padding.

    Request r owns query rows ``query_start_loc[r]:query_start_loc[r+1]``; those are the
    last ``query_len`` positions of its ``seq_lens[r]`` tokens (cached + new).

    Fields (tensors on the model's device):
      query_start_loc: [R+1] int32, cumulative query lengths.
      seq_lens: [R] int32, context length after this step's tokens.
      block_table: [R, max_blocks] int32, block ids per request (padding: 0).
      slot_mapping: [T] int64, cache slot of each new token (block * block_size + offset).
      block_size: slots per block.
      max_query_len / max_seq_len: maxima over the batch.
      query_lens / seq_lens_list: host copies, for backends that loop in Python.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    max_query_len: int
    max_seq_len: int
    query_lens: tuple[int, ...]
    seq_lens_list: tuple[int, ...]

    @property
    def num_requests(self) -> int:
        """R, the number of requests in the step."""
        return len(self.query_lens)

    @property
    def is_pure_decode(self) -> bool:
        """True when every request has exactly one new token."""
        return self.max_query_len == 1


class AttentionBackend(abc.ABC):
    """Computes attention for the flat batch and owns the KV cache tensor layout.

    ``forward`` writes the new k/v into the cache at ``slot_mapping`` and returns attention
    of each new token over its whole cached context (causal within the new tokens).
    """

    def __init__(self, config: Any, spec: AttentionSpec):
        self.config = config
        self.spec = spec

    #: The axis of ``kv_cache_shape`` that indexes blocks: block copies (copy-on-write,
    #: swapping) move the slices along it.
    kv_cache_block_axis = 1

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor: K and V stacked on the first axis."""
        return (2, num_blocks, block_size, self.spec.num_kv_heads, self.spec.head_dim)

    @classmethod
    def resolve(cls, config: Any, spec: AttentionSpec, registry: Any) -> Any:
        """The attention config the engine builds: ``config`` itself, or, for a selector
        such as ``attention=auto``, the config of the backend it picks for ``spec``."""
        return config

    @classmethod
    def unsupported_reasons(cls, config: Any, spec: AttentionSpec) -> list[str]:
        """Why this backend cannot run ``spec`` here (empty when it can)."""
        return []

    def build_metadata(self, layout: BatchLayout) -> Any:
        """Per-step metadata shared by every layer; called once per step."""
        return layout

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any, layer_index: int) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: ``kv_cache_shape``. Returns [T, H, D]."""
