"""The adapter store contract: where LoRA adapters come from (``lora.store``) and how
their PEFT files are read. The engine checks what a store returns (``adapter_from_peft``)
the same way whichever store read it."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class LoRAStoreContext:
    """What the engine hands a store: ``location`` (``lora.store_path``: the folder the
    ``directory`` store serves; a third-party store reads it as it likes, a bucket or an
    address say; None when unset)."""

    location: str | None


@dataclass(frozen=True, slots=True)
class StoredAdapter:
    """One adapter in PEFT's format as a store read it: ``source`` (where it came from:
    ``/v1/models`` shows it as the adapter's root, and ``fetch(name, source)`` reads the
    same adapter again, which is how tensor- and pipeline-parallel workers read their
    share), ``config`` (``adapter_config.json``) and ``tensors`` (the weight file's
    tensors by PEFT's names, in host memory)."""

    source: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]


class LoRAStore(abc.ABC):
    """Where adapters come from, built as ``cls(LoRAStoreContext)``: ``fetch`` reads the one
    a load asks for (``lora.adapters``, ``LLMEngine.load_lora_adapter``,
    ``POST /v1/load_lora_adapter``), ``available`` lists those it serves by name alone.
    A store only reads; the engine checks the adapter (its PEFT config, ranks, modules
    against the model) and keeps it in host memory until it is unloaded."""

    def __init__(self, context: LoRAStoreContext):
        self.context = context

    @abc.abstractmethod
    def fetch(self, name: str, path: str | None) -> StoredAdapter:
        """The adapter a load names ``name`` (``lora_name``) at ``path`` (``lora_path``;
        None when the load gave only a name). ``InvalidRequestError`` naming
        ``lora_name`` or ``lora_path`` when the store has no such adapter or cannot read
        it (not a PEFT adapter, a damaged file)."""

    @abc.abstractmethod
    def available(self) -> list[str]:
        """The names ``fetch(name, None)`` reads, sorted (none for a store that needs a
        path); listed is not checked: loading one may still be refused."""


def open_lora_store(lora_cfg: Any, registry: Any) -> LoRAStore:
    """The store ``lora.store`` names, opened on ``lora.store_path`` (``ConfigError`` listing
    the registered stores for an unknown name)."""
    spec = registry.get("lora_store", lora_cfg.store)
    return spec.cls(LoRAStoreContext(lora_cfg.store_path))
