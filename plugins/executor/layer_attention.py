"""The attention of a model whose layers differ: in window (Gemma's local and global
layers), or in the KV cache group whose block tables they read."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from servelab.core.attention import BatchLayout
from servelab.core.kv_cache import KVCacheGroup


class LayerAttention:
    """One attention backend per distinct layer window (``backends``; ``layer_backend``
    names each layer's) and, per step, the metadata of each layer's KV cache group. A
    model calls it exactly as one backend: ``forward(q, k, v, kv_cache, meta, layer)``
    with the ``build_metadata`` of the step's group layouts. The backends differ only in
    ``AttentionSpec.sliding_window``, so they agree on the cache layout."""

    def __init__(self, backends: Sequence[Any], layer_backend: tuple[int, ...]):
        self.backends = tuple(backends)
        self.layer_backend = layer_backend
        self.layer_group: tuple[int, ...] = (0,) * len(layer_backend)

    @property
    def spec(self) -> Any:
        """The first backend's spec (every backend's but for the window)."""
        return self.backends[0].spec

    @property
    def kv_cache_block_axis(self) -> int:
        """The cache tensors' block axis (``AttentionBackend.kv_cache_block_axis``)."""
        return self.backends[0].kv_cache_block_axis

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's cache tensor shape (``AttentionBackend.kv_cache_shape``)."""
        return self.backends[0].kv_cache_shape(num_blocks, block_size)

    def use_groups(self, groups: Sequence[KVCacheGroup]) -> None:
        """Read each layer's block tables from the group that holds it."""
        owner = {layer: index for index, group in enumerate(groups) for layer in group.layers}
        self.layer_group = tuple(owner[layer] for layer in range(len(self.layer_backend)))

    def build_metadata(self, layouts: Sequence[BatchLayout]) -> tuple[Any, ...]:
        """Each layer's metadata: built once per (group, backend) pair the layers use."""
        built: dict[tuple[int, int], Any] = {}
        metas = []
        for group, backend in zip(self.layer_group, self.layer_backend):
            if (group, backend) not in built:
                built[group, backend] = self.backends[backend].build_metadata(layouts[group])
            metas.append(built[group, backend])
        return tuple(metas)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: tuple[Any, ...], layer_index: int) -> torch.Tensor:
        """Layer ``layer_index``'s attention through its backend and group's metadata."""
        return self.backends[self.layer_backend[layer_index]].forward(q, k, v, kv_cache, meta[layer_index],
                                                                      layer_index)


def layer_attention(build: Any, specs: Sequence[Any]) -> Any:
    """The attention for layers of ``specs`` (one per layer): the one backend ``build(spec)``
    makes when the layers agree, else a ``LayerAttention`` over one backend per distinct spec."""
    distinct = list(dict.fromkeys(specs))
    backends = [build(spec) for spec in distinct]
    if len(backends) == 1:
        return backends[0]
    return LayerAttention(backends, tuple(distinct.index(spec) for spec in specs))
