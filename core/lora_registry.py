"""The LoRA adapters an engine serves, by name: read from the adapter store
(``lora.store``) at start-up for ``lora.adapters`` or at run time (``load``), removed
with ``unload``. A request names one (``lora=``) and
carries the loaded adapter itself, so a request already running when its adapter is
unloaded finishes with it; new requests for the name are refused."""

from __future__ import annotations

import itertools
from typing import Any, Callable

from servelab.core.errors import ConfigError, InvalidRequestError
from servelab.core.lora_adapter import LoRAAdapter, adapter_from_peft


def lora_enabled(lora_cfg: Any) -> bool:
    """True when the engine's ``lora`` config turns LoRA serving on (``enabled``, or any
    ``adapters``)."""
    return lora_cfg is not None and bool(lora_cfg.enabled or lora_cfg.adapters)


class LoRARegistry:
    """Adapters by name, read from ``store`` (a ``LoRAStore``). ``executor`` checks each
    against the model and pages it into its slots (``add_lora``, ``remove_lora``);
    ``max_rank`` bounds their ranks."""

    def __init__(self, executor: Any, max_rank: int, store: Any):
        self.executor = executor
        self.max_rank = max_rank
        self.store = store
        self.adapters: dict[str, LoRAAdapter] = {}
        self._load_ids = itertools.count(1)

    @classmethod
    def of(cls, lora_cfg: Any, executor: Any) -> "LoRARegistry":
        """The registry of an engine config's ``lora`` node with its ``adapters`` loaded
        from the store ``lora.store`` names (built by the executor's registry);
        ``ConfigError`` naming ``lora.adapters.<name>`` for each one that cannot load."""
        from servelab.core.lora_store import open_lora_store

        if executor.lora_stats() is None:
            raise ConfigError([f"lora: {type(executor).__name__} does not serve LoRA adapters; use executor=model"])
        registry = cls(executor, lora_cfg.max_rank, open_lora_store(lora_cfg, executor.context.registry))
        adapters = lora_cfg.adapters or {}
        if not hasattr(adapters, "items"):
            raise ConfigError([f"lora.adapters must map names to PEFT adapter folders ({{name: path}}; a null "
                               f"path: the store's adapter of that name), got {adapters!r}"])
        problems = []
        for name, path in adapters.items():
            try:
                registry.load(name, path)
            except InvalidRequestError as exc:
                problems.append(f"lora.adapters.{name}: {exc}")
        if problems:
            raise ConfigError(problems)
        return registry

    def load(self, name: str, path: str | None = None) -> LoRAAdapter:
        """Read adapter ``name`` at ``path`` (None: by name alone) from the store, check it
        against the model and register it as ``name``; ``InvalidRequestError`` naming the
        field when it cannot be served (the name taken, not in the store, not an adapter,
        a rank above ``max_rank``, modules the model lacks or of other shapes)."""
        return self.register(name, lambda load_id: adapter_from_peft(
            name, self.store.fetch(name, None if path is None else str(path)), self.max_rank, load_id))

    def register(self, name: str, build: Callable[[int], LoRAAdapter]) -> LoRAAdapter:
        """Register as ``name`` the adapter ``build(load_id)`` makes (``load``: read from the
        store; the simulator's adapters without weights), checked against the model;
        ``InvalidRequestError`` naming the field when the name is taken or the adapter
        cannot be served."""
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError("lora_name", f"must be a non-empty string, got {name!r}")
        if name in self.adapters:
            raise InvalidRequestError("lora_name", f"an adapter named {name!r} is already loaded "
                                                   f"({self.adapters[name].path}); unload it first")
        adapter = build(next(self._load_ids))
        self.executor.add_lora(adapter)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> LoRAAdapter:
        """Stop serving ``name`` (running requests finish with it); ``InvalidRequestError``
        when no adapter has that name."""
        adapter = self.get(name, "lora_name")
        del self.adapters[name]
        self.executor.remove_lora(adapter)
        return adapter

    def get(self, name: str, field: str = "lora") -> LoRAAdapter:
        """The adapter loaded as ``name``; ``InvalidRequestError`` on ``field`` otherwise."""
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidRequestError(field, f"unknown LoRA adapter {name!r}; loaded: {loaded}")
        return adapter
