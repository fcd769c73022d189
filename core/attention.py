"""The attention backend contract and the flat batch layout it reads."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from servelab.core.kv_cache_dtype import SCALE_BYTES, is_quantized

@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """The attention shape of one model: ``num_heads`` query heads and ``num_kv_heads``
    KV heads of ``head_dim``, softmax ``scale``, compute ``dtype`` on ``device``, an
    optional ``sliding_window`` (None = full attention), ``kv_dtype``, the KV cache's
    element type (None = ``dtype``; int8 or float8_e4m3fn: quantized, ``cache.kv_dtype``),
    and ``softcap``: when set, scaled scores become ``softcap * tanh(scores / softcap)``
    before masking and softmax (Gemma 2's attention logit soft-capping; None = none);
    ``values_are_keys``: each token's value is its key, so the cache holds keys alone
    (latent attention in its absorbed form: the output is the softmax-weighted keys, of
    which the model keeps the latent part); ``forward`` then receives ``v`` equal to ``k``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype
    device: torch.device
    sliding_window: int | None = None
    kv_dtype: torch.dtype | None = None
    softcap: float | None = None
    values_are_keys: bool = False

    @property
    def kv_parts(self) -> int:
        """Tensors cached per token and KV head: 2 (key and value), 1 (values are keys)."""
        return 1 if self.values_are_keys else 2

    @property
    def cache_dtype(self) -> torch.dtype:
        """The element type of the KV cache tensors."""
        return self.kv_dtype or self.dtype

    @property
    def kv_quantized(self) -> bool:
        """True when the cache stores one-byte values with a float32 scale per slot and head."""
        return is_quantized(self.cache_dtype)


@dataclass(frozen=True, slots=True)
class TreeMask:
    """Which keys of a token tree each new token reads (``core/token_tree.py`` builds it).

    Request r's tree occupies the last ``lens[r]`` keys of its context (0: no tree, plain
    causal attention); its keys before the tree are read by every new token. New token t
    (a row of the flat batch) reads tree key j of its request iff ``mask[t, j]``: its
    ancestors and itself.

    Fields: ``mask`` [T, W] bool on the model's device (W = max(lens)); ``lens``: per
    request (host); ``lens_tensor``: the same, int32 [R] on the model's device.
    """

    mask: torch.Tensor
    lens: tuple[int, ...]
    lens_tensor: torch.Tensor


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
      tree: token trees verified or drafted this step (None: every request is causal).
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
    tree: TreeMask | None = None

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
    #: True when ``forward`` reads a quantized cache (``AttentionSpec.kv_quantized``); the
    #: executor refuses ``cache.kv_dtype=int8 | fp8_e4m3`` with a backend that does not.
    reads_quantized_kv = False
    #: True when ``forward`` masks the token trees of ``BatchLayout.tree`` and
    #: ``copy_slots`` fits ``kv_cache_shape``; the executor refuses token trees otherwise.
    reads_token_trees = False
    #: True when ``forward`` and ``copy_slots`` handle a cache of keys alone whose values are
    #: the keys (``AttentionSpec.values_are_keys``, latent attention); the executor refuses
    #: such a model with a backend that does not.
    reads_values_from_keys = False

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor (dtype ``spec.cache_dtype``): K and V stacked on
        the first axis (K alone when ``spec.values_are_keys``: values are read from it, so
        ``[-1]`` is the values either way); a quantized cache's rows hold D values then the
        4 bytes of their float32 scale, so block copies, swapping and prefix caching carry
        the scales."""
        row = self.spec.head_dim + (SCALE_BYTES if self.spec.kv_quantized else 0)
        return (self.spec.kv_parts, num_blocks, block_size, self.spec.num_kv_heads, row)

    def copy_slots(self, kv_cache: torch.Tensor, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copy the keys and values at cache slots ``sources`` [n] int64 to ``destinations``
        [n] (a verified token tree's kept path moved into consecutive slots); every source
        is read before any destination is written. A backend with its own cache layout
        overrides it."""
        raw = kv_cache.view(torch.uint8) if self.spec.kv_quantized else kv_cache
        flat = raw.view(raw.shape[0], -1, raw.shape[-2], raw.shape[-1])
        flat[:, destinations] = flat[:, sources]

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
