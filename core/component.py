"""How a plugin describes one component it provides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

KINDS = ("scheduler", "cache", "attention", "decoding", "model", "eviction", "executor", "cost_model", "router",
         "kv_transfer", "policy", "kv_tier", "lora_store")
"""Component kinds; each but ``model``, ``eviction``, ``kv_tier`` and ``lora_store`` is a
Hydra config group of the same name."""


@dataclass(frozen=True, slots=True)
class ComponentSpec:
    """One registered component.

    ``kind``: one of ``KINDS``. ``name``: the option users select (``scheduler=<name>``;
    for ``model`` the ``architectures`` entry of ``config.json``). ``cls``: the class the
    engine builds. ``config_cls``: its config dataclass (the Hydra schema; None for
    models). ``description``: one line for ``--help`` and the docs.
    """

    kind: str
    name: str
    cls: type
    config_cls: type | None
    description: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ComponentSpec.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


class ComponentBuilder(Protocol):
    """What a component may ask of the engine's registry (a context's ``registry``): the
    components of a kind and how to build one. ``servelab.core.engine.registry.Registry`` is one."""

    def get(self, kind: str, name: str) -> ComponentSpec:
        """The component ``name`` of ``kind``; ``ConfigError`` listing the others if unknown."""

    def spec_for_config(self, kind: str, config: Any) -> ComponentSpec:
        """The component whose config dataclass is the type of ``config``."""

    def build(self, kind: str, config: Any, *args: Any) -> Any:
        """The component ``config`` selects, built as ``cls(config_object, *args)``."""
