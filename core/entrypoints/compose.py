"""Compose a servelab config from overrides, inside or outside a running Hydra app."""

from __future__ import annotations

import copy

from omegaconf import DictConfig, read_write

from servelab.core.config import store_schemas
from servelab.core.errors import ConfigError
from servelab.core.engine.registry import get_registry


def prepare_hydra() -> None:
    """Register schemas and every plugin's config node before Hydra composes."""
    store_schemas()
    get_registry()


def compose_config(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose ``conf/<config_name>.yaml`` with Hydra overrides (``["cache=contiguous"]``)."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    prepare_hydra()
    overrides = list(overrides or [])
    if GlobalHydra.instance().is_initialized():
        return compose(config_name=config_name, overrides=overrides)
    with initialize_config_module(config_module="servelab.conf", version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def app_overrides() -> list[str] | None:
    """The command line's overrides of the running Hydra app (what a pool's config is
    composed from before its own overrides); None outside one."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def compose_pool_config(cfg: DictConfig, role: str, base_overrides: list[str] | None, config_name: str) -> DictConfig:
    """The config of one instance of pool ``role``: a copy of ``cfg`` when the pool has no
    overrides, else ``conf/<config_name>.yaml`` composed again with ``base_overrides``
    (the app's, ``app_overrides()``) then the pool's; ``role`` set either way.
    ``ConfigError`` when the pool has overrides and ``base_overrides`` is None (outside a
    Hydra app: ``cfg``'s own overrides are not known)."""
    overrides = list(cfg.deployment[role].overrides)
    if overrides and base_overrides is None:
        raise ConfigError([f"deployment.{role}.overrides recompose the app's config from its command line, which "
                           f"is known only inside a Hydra app (servelab-serve, servelab-bench)"])
    if overrides:
        pool = compose_config(list(base_overrides) + overrides, config_name=config_name)
    else:
        pool = copy.deepcopy(cfg)
    with read_write(pool):
        pool.role = role
    return pool
