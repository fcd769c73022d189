"""The component registry: the only place that talks to pluggy.

Plugins (the built-ins included) are found through the ``servelab`` entry-point group.
A plugin that fails to import is logged and skipped; selecting one of its components
later reports the import error. A plugin that registers components must declare the
plugin API versions it supports (``core/plugin_api.py``); one that does not support
this servelab's fails the registry's construction with a ``ConfigError`` naming it.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Any

import pluggy
from omegaconf import DictConfig, OmegaConf

from servelab.core import hookspecs
from servelab.core.component import KINDS, ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.plugin_api import api_problem

log = logging.getLogger(__name__)

REGISTER_HOOKS = {
    "scheduler": "servelab_register_schedulers",
    "cache": "servelab_register_kv_caches",
    "attention": "servelab_register_attention_backends",
    "decoding": "servelab_register_decoding_strategies",
    "model": "servelab_register_models",
    "eviction": "servelab_register_eviction_policies",
    "executor": "servelab_register_executors",
    "cost_model": "servelab_register_cost_models",
    "router": "servelab_register_routers",
    "kv_transfer": "servelab_register_kv_transfers",
    "policy": "servelab_register_policies",
    "kv_tier": "servelab_register_kv_tiers",
    "lora_store": "servelab_register_lora_stores",
}
CONFIG_GROUPS = ("cache", "attention", "scheduler", "decoding", "executor", "cost_model", "router", "kv_transfer",
                 "policy")
"""Kinds that are Hydra config groups (models are picked from ``config.json``; eviction
policies by name with ``cache.eviction``, KV tiers with ``cache.lower_tier``, adapter
stores with ``lora.store``)."""


class Registry:
    """Collects ``ComponentSpec`` entries from every plugin and builds components."""

    def __init__(self, plugins: tuple[Any, ...] = (), load_entry_points: bool = True):
        self.plugin_manager = pluggy.PluginManager("servelab")
        self.plugin_manager.add_hookspecs(hookspecs)
        self.failed_plugins: dict[str, str] = {}
        if load_entry_points:
            self._load_entry_points()
        for plugin in plugins:
            self.plugin_manager.register(plugin)
        self.plugin_manager.check_pending()
        self._check_api_versions()
        self._specs = {kind: self._collect(kind) for kind in KINDS}

    def _check_api_versions(self) -> None:
        """Refuse, all at once, every component plugin that does not support this plugin API."""
        hooks = set(REGISTER_HOOKS.values())
        manager = self.plugin_manager
        problems = [problem for name, plugin in manager.list_name_plugin()
                    if any(caller.name in hooks for caller in manager.get_hookcallers(plugin) or ())
                    and (problem := api_problem(name, plugin)) is not None]
        if problems:
            raise ConfigError(problems)

    def _load_entry_points(self) -> None:
        for entry_point in importlib.metadata.entry_points(group="servelab"):
            if self.plugin_manager.get_plugin(entry_point.name) is not None:
                continue
            try:
                plugin = entry_point.load()
            except Exception as exc:  # a broken third-party plugin must not take servelab down
                self.failed_plugins[entry_point.name] = f"{type(exc).__name__}: {exc}"
                log.warning("servelab plugin %r failed to import and is skipped: %s", entry_point.name, exc)
                continue
            self.plugin_manager.register(plugin, name=entry_point.name)

    def _collect(self, kind: str) -> dict[str, ComponentSpec]:
        hook = getattr(self.plugin_manager.hook, REGISTER_HOOKS[kind])
        specs: dict[str, ComponentSpec] = {}
        for result in hook():
            for spec in result or []:
                if spec.kind != kind:
                    raise ConfigError([f"{REGISTER_HOOKS[kind]} returned a {spec.kind!r} component {spec.name!r}"])
                if spec.name in specs:
                    raise ConfigError([f"two plugins register the {kind} {spec.name!r}"])
                specs[spec.name] = spec
        return specs

    @property
    def hook(self):
        """The pluggy hook relay, for observer hooks."""
        return self.plugin_manager.hook

    def specs(self, kind: str) -> dict[str, ComponentSpec]:
        """Registered components of ``kind`` by name."""
        return self._specs[kind]

    def get(self, kind: str, name: str) -> ComponentSpec:
        """The component ``name`` of ``kind``; unknown names list the available ones."""
        specs = self._specs[kind]
        if name not in specs:
            available = ", ".join(sorted(specs)) or "none"
            hint = "".join(f"; plugin {p!r} failed to import ({e})" for p, e in self.failed_plugins.items())
            raise ConfigError([f"unknown {kind} {name!r}; available: {available}{hint}"])
        return specs[name]

    def store_configs(self) -> None:
        """Put every component's config dataclass into Hydra's ConfigStore (group = kind)."""
        from hydra.core.config_store import ConfigStore

        store = ConfigStore.instance()
        for kind in CONFIG_GROUPS:
            for name, spec in self._specs[kind].items():
                store.store(group=kind, name=name, node=spec.config_cls, provider=spec.cls.__module__)

    def spec_for_config(self, kind: str, config: Any) -> ComponentSpec:
        """The component whose config dataclass is the type of ``config``."""
        config_type = OmegaConf.get_type(config) if isinstance(config, DictConfig) else type(config)
        for spec in self._specs[kind].values():
            if spec.config_cls is config_type:
                return spec
        raise ConfigError([f"{kind} config of type {getattr(config_type, '__name__', config_type)} "
                           f"matches no registered {kind}; available: {', '.join(sorted(self._specs[kind]))}"])

    def build(self, kind: str, config: Any, *args: Any) -> Any:
        """Instantiate the component selected by ``config`` as ``cls(config_object, *args)``."""
        spec = self.spec_for_config(kind, config)
        obj = OmegaConf.to_object(config) if isinstance(config, DictConfig) else config
        return spec.cls(obj, *args)


_default: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use and stored into Hydra's ConfigStore."""
    global _default
    if _default is None:
        _default = Registry()
        _default.store_configs()
    return _default
