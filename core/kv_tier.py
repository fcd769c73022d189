"""The KV tier contract: a store of cached prefix blocks below host memory (``cache.lower_tier``)."""

from __future__ import annotations

import abc
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class TierEntry:
    """One cached block: its chained ``digest`` (``block_hash``), its ``parent``'s (None:
    a first block without a cache salt) and its ``tokens``. Equal entries hold equal KV."""

    digest: int
    parent: int | None
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVTierContext:
    """What the paged cache hands a tier: ``location`` (``cache.lower_tier_path``: a folder
    for ``disk``; a third-party tier reads it as it likes, an address say),
    ``capacity_bytes`` (``cache.lower_tier_bytes``), ``block_bytes`` (one block's content
    in every layer: what ``save`` and ``load`` move) and ``fingerprint`` (what that content
    depends on: the model's weights, the KV layout, block size and element type; a tier
    that outlives the engine serves only blocks saved under the same fingerprint)."""

    location: str | None
    capacity_bytes: int
    block_bytes: int
    fingerprint: str

    @property
    def capacity_blocks(self) -> int:
        """How many blocks the budget holds."""
        return self.capacity_bytes // self.block_bytes


class KVTier(abc.ABC):
    """A store of cached KV blocks below the host tier, built as ``cls(KVTierContext)``.

    The paged cache keeps the index (which entries the tier holds, least recently used
    first, at most ``capacity_blocks``) and decides what moves; the tier only keeps
    content. A block evicted from the host tier is ``save``d; a prefix hit in the tier is
    ``load``ed back into a host block, then onto the device. ``save``, ``load`` and
    ``discard`` run on one background thread, in the order the cache asked for them,
    overlapped with the step in flight. ``stored`` says what the tier holds when it opens
    (a tier that survives a restart: what earlier runs saved). A tier never returns wrong
    content: ``load`` answers False for a block it cannot vouch for (missing, truncated,
    failing its check), which the cache treats as a miss and recomputes.
    """

    def __init__(self, context: KVTierContext):
        self.context = context

    @abc.abstractmethod
    def stored(self) -> list[TierEntry]:
        """The blocks the tier holds as it opens, least recently used first."""

    @abc.abstractmethod
    def save(self, entry: TierEntry, payload: torch.Tensor) -> bool:
        """Keep ``payload`` (uint8, ``block_bytes`` long) under ``entry``; False when it
        could not (no space, an I/O error: logged), and a later ``load`` then misses."""

    @abc.abstractmethod
    def load(self, entry: TierEntry, out: torch.Tensor) -> bool:
        """Fill ``out`` (uint8, ``block_bytes``) with what was saved under ``entry``;
        False when that is missing or fails the tier's check (``out`` is then garbage)."""

    @abc.abstractmethod
    def discard(self, digest: int) -> None:
        """Forget the block saved under ``digest`` (the index evicted it)."""

    def close(self) -> None:
        """Release what the tier holds open (its saved blocks stay where they persist);
        nothing by default."""


def kv_fingerprint(source: str, hf_config: Any, layout: dict[str, Any]) -> str:
    """A short digest of what a cached block's content depends on: the model (its
    ``source``, config and, for a folder, each weight file's name, size and modification
    time) and the ``layout`` (KV shape, element type, block size, parallel split)."""
    weights = []
    folder = Path(source)
    if folder.is_dir():
        weights = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())
                   if p.suffix in (".safetensors", ".bin", ".pt", ".gguf")]
    config = hf_config.to_json_string() if hasattr(hf_config, "to_json_string") else repr(hf_config)
    text = json.dumps([source, config, weights, layout], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
