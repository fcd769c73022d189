"""Compose a servelab config from overrides, inside or outside a running Hydra app."""

from __future__ import annotations

import copy

from omegaconf import DictConfig, read_write

from servelab.core.config import store_schemas
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


def compose_pool_config(cfg: DictConfig, role: str, base_overrides: list[str], config_name: str) -> DictConfig:
    """The config of one instance of pool ``role``: a copy of ``cfg`` when the pool has no
    overrides, else ``conf/<config_name>.yaml`` composed again with ``base_overrides``
    (the app's) then the pool's; ``role`` set either way."""
    overrides = list(cfg.deployment[role].overrides)
    if overrides:
        pool = compose_config(list(base_overrides) + overrides, config_name=config_name)
    else:
        pool = copy.deepcopy(cfg)
    with read_write(pool):
        pool.role = role
    return pool
